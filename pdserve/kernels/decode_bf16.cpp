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

// Pointers to each context position's row of one KV head (page by page, no division).
void key_rows(const bf16* buf, const int64_t* pages, int64_t len, int64_t ps, int64_t tok,
              int64_t off, std::vector<const bf16*>& rows) {
  rows.resize(len);
  for_each_slot(buf, pages, len, ps, tok, off, [&](int64_t t, const bf16* r) { rows[t] = r; });
}

// s[g][t] = scale * q_g . k_t for t < len.
void scores(const __m512i (*qv)[kMaxC], int64_t G, int64_t C,
            const std::vector<const bf16*>& k, int64_t len, float scale, float* s,
            int64_t stride) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 part[16];
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t j = 0; j < 16; ++j) {
        __m512 acc = _mm512_setzero_ps();
        if (j < n)
          for (int64_t c = 0; c < C; ++c)
            acc = _mm512_dpbf16_ps(acc, as_bh(_mm512_loadu_si512(k[t0 + j] + 32 * c)),
                                   as_bh(qv[g][c]));
        part[j] = acc;
      }
      const __m512 r = _mm512_mul_ps(reduce16(part), sc);
      _mm512_mask_storeu_ps(s + g * stride + t0, (__mmask16)((1u << n) - 1), r);
    }
  }
}

// acc[g][2c], acc[g][2c + 1] += interleaved P.V over the keys, two at a time.
void accumulate(const std::vector<const bf16*>& v, int64_t len, const uint16_t* p,
                int64_t stride, int64_t G, int64_t C, __m512* acc) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < len; t += 2) {
    const bool pair = t + 1 < len;
    for (int64_t c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(v[t] + 32 * c);
      const __m512i b = pair ? _mm512_loadu_si512(v[t + 1] + 32 * c) : zero;
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      for (int64_t g = 0; g < G; ++g) {
        int32_t pp;  // p[g][t], p[g][t + 1] (the latter 0 past the end)
        std::memcpy(&pp, p + g * stride + t, sizeof(pp));
        const __m512i pb = _mm512_set1_epi32(pp);
        acc[(g * C + c) * 2] = _mm512_dpbf16_ps(acc[(g * C + c) * 2], as_bh(lo), as_bh(pb));
        acc[(g * C + c) * 2 + 1] =
            _mm512_dpbf16_ps(acc[(g * C + c) * 2 + 1], as_bh(hi), as_bh(pb));
      }
    }
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

void decode_impl(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                 const at::Tensor& table, const at::Tensor& lens, at::Tensor& out, int64_t ps,
                 double scale) {
  const int64_t B = out.size(0), H = out.size(1), D = out.size(2);
  const int64_t Hkv = kb.size(1), G = H / Hkv, P = table.size(1), C = D / 32;
  const int64_t qrow = q.stride(0), tok = Hkv * D;
  const auto* qp = q.data_ptr<bf16>();
  const auto* kp = kb.data_ptr<bf16>();
  const auto* vp = vb.data_ptr<bf16>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  auto* op = out.data_ptr<bf16>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b0, int64_t e0) {
    std::vector<const bf16*> krows, vrows;
    std::vector<float> s;
    std::vector<uint16_t> p;
    std::vector<__m512> acc(G * C * 2);
    std::vector<float> tmp(D);
    std::vector<float> inv(G);
    __m512i qv[kMaxG][kMaxC];
    for (int64_t task = b0; task < e0; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv, len = lp[b];
      const int64_t stride = (len + 16) / 16 * 16;  // >= len + 1: room for p's pad
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c)
          qv[g][c] = _mm512_loadu_si512(qp + b * qrow + (hk * G + g) * D + 32 * c);
      key_rows(kp, tp + b * P, len, ps, tok, hk * D, krows);
      key_rows(vp, tp + b * P, len, ps, tok, hk * D, vrows);
      s.resize(G * stride);
      p.resize(G * stride);
      scores(qv, G, C, krows, len, static_cast<float>(scale), s.data(), stride);
      for (int64_t g = 0; g < G; ++g)
        inv[g] = probabilities(s.data() + g * stride, len, p.data() + g * stride);
      for (auto& a : acc) a = _mm512_setzero_ps();
      accumulate(vrows, len, p.data(), stride, G, C, acc.data());
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t c = 0; c < C; ++c)  // lane 4L + i of lo is dim 8L + i, of hi 8L + 4 + i
          for (int half = 0; half < 2; ++half) {
            alignas(64) float lanes[16];
            _mm512_store_ps(lanes, acc[(g * C + c) * 2 + half]);
            for (int L = 0; L < 4; ++L)
              for (int i = 0; i < 4; ++i) tmp[32 * c + 8 * L + 4 * half + i] = lanes[4 * L + i];
          }
        bf16* o = op + (b * H + hk * G + g) * D;
        for (int64_t d = 0; d < D; d += 16) store16(o + d, load16(tmp.data() + d) * inv[g]);
      }
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
