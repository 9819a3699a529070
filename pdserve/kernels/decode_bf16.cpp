// Decode attention for bfloat16 on CPUs with AVX512-BF16 (docs/architecture.md: "Engine
// speed"): one new token per request over its whole context, read from the paged pool in
// place, like cpu_ops.cpp's portable `decode_attention`, but with VDPBF16PS (two bf16
// products summed into a float lane per instruction) instead of widening every key and value
// to float:
//   - scores, 16 keys at a time: q . k as 16 partial sums per key, then one transposed tree
//     reduction turns the 16 vectors into the 16 keys' scores (instead of a horizontal sum
//     per key);
//   - P.V, two keys at a time: the two value rows interleaved (VPUNPCK{L,H}WD) against the
//     pair of their bf16 probabilities broadcast; the interleave permutes the head dims
//     within each 128-bit lane, undone once when the output is written.
// Probabilities are rounded to bf16 before P.V (as torch's CPU flash attention and
// extend_attention.cpp do); softmax max, sum and the accumulation stay in float.
// A task is one request's KV heads: all of them when there are >= 4 requests per thread
// (the page walk is then one contiguous stream: decode is memory-bound), one otherwise.
//
// Shapes: q [B, H, D] (heads contiguous); pools [slots, Hkv, D]; table [B, P] pages;
// lens [B] context length incl. the new token; out [B, H, D]. D % 32 == 0, G = H / Hkv.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
using bf16 = c10::BFloat16;
constexpr int64_t kMaxC = 8;   // D / 32 vectors of a head (D <= 256)
constexpr int64_t kMaxG = 16;  // query heads per KV head

// r[j] = sum of the 16 lanes of v[j], j < 16: pairs, quads, then 128-bit lanes (45 ops).
inline __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Pulls the slots of positions [t0, t1) towards the cache: `bytes` from each row.
template <int Hint = _MM_HINT_T0>
inline void prefetch_rows(const bf16* const* rows, int64_t t0, int64_t t1, int64_t bytes) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t o = 0; o < bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[t]) + o, static_cast<_mm_hint>(Hint));
}

// Pointers to each context position's row of one KV head (page by page, no division).
void key_rows(const bf16* buf, const int64_t* pages, int64_t len, int64_t ps, int64_t tok,
              int64_t off, std::vector<const bf16*>& rows) {
  rows.resize(len);
  for_each_slot(buf, pages, len, ps, tok, off, [&](int64_t t, const bf16* r) { rows[t] = r; });
}

// s[g][t] = scale * q_g . k_t for t < len, k_t = k[t] + off (C = D / 32 compile-time:
// the per-key products are unrolled).
template <int C>
void scores_c(const __m512i (*qv)[kMaxC], int64_t G, const bf16* const* k, int64_t off,
              int64_t len, float scale, float* s, int64_t stride) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 part[16];
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t j = 0; j < 16; ++j) {
        __m512 acc = _mm512_setzero_ps();
        if (j < n)
          for (int c = 0; c < C; ++c)
            acc = _mm512_dpbf16_ps(acc, as_bh(_mm512_loadu_si512(k[t0 + j] + off + 32 * c)),
                                   as_bh(qv[g][c]));
        part[j] = acc;
      }
      const __m512 r = _mm512_mul_ps(reduce16(part), sc);
      _mm512_mask_storeu_ps(s + g * stride + t0, (__mmask16)((1u << n) - 1), r);
    }
  }
}

void scores(const __m512i (*qv)[kMaxC], int64_t G, int64_t C, const bf16* const* k,
            int64_t off, int64_t len, float scale, float* s, int64_t stride) {
  switch (C) {
    case 1: return scores_c<1>(qv, G, k, off, len, scale, s, stride);
    case 2: return scores_c<2>(qv, G, k, off, len, scale, s, stride);
    case 3: return scores_c<3>(qv, G, k, off, len, scale, s, stride);
    case 4: return scores_c<4>(qv, G, k, off, len, scale, s, stride);
    case 5: return scores_c<5>(qv, G, k, off, len, scale, s, stride);
    case 6: return scores_c<6>(qv, G, k, off, len, scale, s, stride);
    case 7: return scores_c<7>(qv, G, k, off, len, scale, s, stride);
    default: return scores_c<kMaxC>(qv, G, k, off, len, scale, s, stride);
  }
}

// acc[g][c][0..1] += interleaved P.V of one KV head's G query heads (`off` elements into
// each row) over the keys, two at a time; p holds their probabilities, `stride` apart.
// G and C are compile-time here, so the accumulators stay in registers; `span` > 0 pulls
// every head's bytes of the rows ahead (the first head's walk; the others then hit cache).
template <int G, int C>
void accumulate_head(const bf16* const* v, int64_t len, const uint16_t* p, int64_t stride,
                     int64_t off, int64_t span, __m512* acc) {
  const __m512i zero = _mm512_setzero_si512();
  __m512 a[G][C][2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c][0] = a[g][c][1] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 2) {
    const bool pair = t + 1 < len;
    if (span && t % 16 == 0)
      prefetch_rows(v, std::min(len, t + 16), std::min(len, t + 32), span);
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(v[t] + off + 32 * c);
      const __m512i y = pair ? _mm512_loadu_si512(v[t + 1] + off + 32 * c) : zero;
      const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
      for (int g = 0; g < G; ++g) {
        int32_t pp;  // p[g][t], p[g][t + 1] (the latter 0 past the end)
        std::memcpy(&pp, p + g * stride + t, sizeof(pp));
        const __m512i pb = _mm512_set1_epi32(pp);
        a[g][c][0] = _mm512_dpbf16_ps(a[g][c][0], as_bh(lo), as_bh(pb));
        a[g][c][1] = _mm512_dpbf16_ps(a[g][c][1], as_bh(hi), as_bh(pb));
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) acc[(g * C + c) * 2 + h] = a[g][c][h];
}

using HeadFn = void (*)(const bf16* const*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                        __m512*);

// The register version for shapes whose 2 * G * C accumulators fit in 24 registers.
template <int C>
HeadFn head_fn_for(int64_t G) {
  switch (G) {
    case 1: return &accumulate_head<1, C>;
    case 2: return &accumulate_head<2, C>;
    case 3: if (3 * C <= 12) return &accumulate_head<3, C>; break;
    case 4: if (4 * C <= 12) return &accumulate_head<4, C>; break;
    case 6: if (6 * C <= 12) return &accumulate_head<6, C>; break;
    case 8: if (8 * C <= 12) return &accumulate_head<8, C>; break;
  }
  return nullptr;
}

HeadFn head_fn(int64_t G, int64_t C) {
  switch (C) {
    case 1: return head_fn_for<1>(G);
    case 2: return head_fn_for<2>(G);
    case 4: return head_fn_for<4>(G);
  }
  return nullptr;
}

// One query head at a time (G = 1), for the shapes head_fn has no register version of.
HeadFn one_head_fn(int64_t C) {
  switch (C) {
    case 1: return &accumulate_head<1, 1>;
    case 2: return &accumulate_head<1, 2>;
    case 3: return &accumulate_head<1, 3>;
    case 4: return &accumulate_head<1, 4>;
    case 5: return &accumulate_head<1, 5>;
    case 6: return &accumulate_head<1, 6>;
    case 7: return &accumulate_head<1, 7>;
    default: return &accumulate_head<1, kMaxC>;
  }
}

// acc[i][c][0..1] for the query heads i < nkv * G of `nkv` KV heads side by side in each row
// (D apart): one walk per KV head, the first one pulling the whole span into cache.
void accumulate(const std::vector<const bf16*>& v, int64_t len, const uint16_t* p,
                int64_t stride, int64_t nkv, int64_t G, int64_t C, int64_t D, int64_t span,
                __m512* acc) {
  const HeadFn fn = head_fn(G, C);
  for (int64_t hk = 0; hk < nkv; ++hk) {
    const uint16_t* ph = p + hk * G * stride;
    __m512* ah = acc + hk * G * C * 2;
    const int64_t pull = hk == 0 ? span : 0;
    if (fn) {
      fn(v.data(), len, ph, stride, hk * D, pull, ah);
      continue;
    }
    const HeadFn one = one_head_fn(C);  // a walk per query head (the first from memory)
    for (int64_t g = 0; g < G; ++g)
      one(v.data(), len, ph + g * stride, stride, hk * D, g == 0 ? pull : 0, ah + g * C * 2);
  }
}

// Softmax numerators of one head's scores as bf16 (p[len] = 0 pads the last pair);
// returns 1 / (their float sum).
float probabilities(float* s, int64_t len, uint16_t* p) {
  float m = -INFINITY;
  for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
  v16 acc{};
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) {
    const v16 e = vexp(load16(s + t) - m);
    acc += e;
    store16(reinterpret_cast<bf16*>(p + t), e);
  }
  float sum = hsum(acc);
  for (; t < len; ++t) {
    const float e = std::exp(s[t] - m);
    sum += e;
    p[t] = c10::BFloat16(e).x;
  }
  p[len] = 0;
  return 1.f / sum;
}

// Working buffers of one thread, reused across its tasks.
struct Scratch {
  std::vector<const bf16*> krows, vrows;  // each context position's token slot
  std::vector<float> s;                   // [heads * G, stride] scores
  std::vector<uint16_t> p;                // [heads * G, stride] bf16 probabilities
  std::vector<__m512> acc;                // [heads * G, C, 2] interleaved P.V sums
  std::vector<float> inv, tmp;
};

// Request b's query heads of KV heads [h0, h1). All of them walk the context together, 16
// positions at a time: a page holds each position's every KV head side by side, so the
// walk reads the pool as one contiguous stream per page instead of one strided stream per
// KV head (a decode batch's contexts do not fit in the cache: this is memory-bound). Each
// head's own sums run in the same order as with one head per task: the bits do not depend
// on how a batch is split into tasks.
void decode_task(const bf16* qp, int64_t qrow, const bf16* kp, const bf16* vp,
                 const int64_t* pages, int64_t len, int64_t ps, int64_t Hkv, int64_t G,
                 int64_t D, int64_t b, int64_t h0, int64_t h1, float scale, bf16* op,
                 Scratch& w) {
  const int64_t C = D / 32, tok = Hkv * D, heads = (h1 - h0) * G, H = Hkv * G;
  const int64_t stride = (len + 16) / 16 * 16;  // >= len + 1: room for p's pad
  const int64_t span = (h1 - h0) * D * 2;        // bytes of a slot these heads read
  key_rows(kp, pages, len, ps, tok, h0 * D, w.krows);
  key_rows(vp, pages, len, ps, tok, h0 * D, w.vrows);
  w.s.resize(heads * stride);
  w.p.resize(heads * stride);
  w.inv.resize(heads);
  w.tmp.resize(D);
  __m512i qv[kMaxG][kMaxC];
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    prefetch_rows(w.krows.data(), std::min(len, t0 + 16), std::min(len, t0 + 32), span);
    // the values of these positions, towards L2 for the P.V walk that follows
    prefetch_rows<_MM_HINT_T1>(w.vrows.data(), t0, t0 + std::min<int64_t>(16, len - t0), span);
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t hk = 0; hk < h1 - h0; ++hk) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c)
          qv[g][c] = _mm512_loadu_si512(qp + b * qrow + ((h0 + hk) * G + g) * D + 32 * c);
      scores(qv, G, C, w.krows.data() + t0, hk * D, n, scale,
             w.s.data() + hk * G * stride + t0, stride);
    }
  }
  for (int64_t i = 0; i < heads; ++i)
    w.inv[i] = probabilities(w.s.data() + i * stride, len, w.p.data() + i * stride);
  w.acc.assign(heads * C * 2, _mm512_setzero_ps());
  accumulate(w.vrows, len, w.p.data(), stride, h1 - h0, G, C, D, span, w.acc.data());
  for (int64_t i = 0; i < heads; ++i) {
    for (int64_t c = 0; c < C; ++c)  // lane 4L + j of lo is dim 8L + j, of hi 8L + 4 + j
      for (int half = 0; half < 2; ++half) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, w.acc[(i * C + c) * 2 + half]);
        for (int L = 0; L < 4; ++L)
          for (int j = 0; j < 4; ++j) w.tmp[32 * c + 8 * L + 4 * half + j] = lanes[4 * L + j];
      }
    bf16* o = op + (b * H + h0 * G + i) * D;
    for (int64_t d = 0; d < D; d += 16) store16(o + d, load16(w.tmp.data() + d) * w.inv[i]);
  }
}

void decode_impl(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                 const at::Tensor& table, const at::Tensor& lens, at::Tensor& out, int64_t ps,
                 double scale) {
  const int64_t B = out.size(0), D = out.size(2);
  const int64_t Hkv = kb.size(1), G = out.size(1) / Hkv, P = table.size(1);
  const auto* qp = q.data_ptr<bf16>();
  const auto* kp = kb.data_ptr<bf16>();
  const auto* vp = vb.data_ptr<bf16>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  auto* op = out.data_ptr<bf16>();
  // Whole requests per task when there are enough of them to keep every thread busy (the
  // contiguous walk); else one KV head per task, so a few long rows still spread out.
  const int64_t split = B >= 4 * at::get_num_threads() ? 1 : Hkv;
  at::parallel_for(0, B * split, 1, [&](int64_t b0, int64_t e0) {
    Scratch w;
    for (int64_t task = b0; task < e0; ++task) {
      const int64_t b = task / split, part = task % split;
      const int64_t h0 = split == 1 ? 0 : part, h1 = split == 1 ? Hkv : part + 1;
      decode_task(qp, q.stride(0), kp, vp, tp + b * P, lp[b], ps, Hkv, G, D, b, h0, h1,
                  static_cast<float>(scale), op, w);
    }
  });
}
#endif

}  // namespace

// True when this build has the kernel and it serves these heads (else: cpu_ops.cpp's).
bool decode_bf16_serves(int64_t H, int64_t Hkv, int64_t D) {
#if defined(__AVX512BF16__)
  return D % 32 == 0 && D <= 32 * kMaxC && H % Hkv == 0 && H / Hkv <= kMaxG;
#else
  (void)H, (void)Hkv, (void)D;
  return false;
#endif
}

void decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& table, const at::Tensor& lens, at::Tensor& out,
                           int64_t page_size, double scale) {
#if defined(__AVX512BF16__)
  decode_impl(q, k_buf, v_buf, table, lens, out, page_size, scale);
#else
  TORCH_CHECK(false, "decode_attention_bf16: needs a CPU with AVX512-BF16");
#endif
}
