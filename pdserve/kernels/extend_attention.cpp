// Causal attention of prompt tokens over the paged KV pool, for bfloat16 on CPUs with
// AVX512-BF16 (docs/architecture.md: "Engine speed").
//
// Each request (row) b has start[b] cached tokens and q_len[b] new ones; its new tokens sit
// consecutively in q [T, H, D] and its whole context (cached + new, written by rope_and_store
// first) is in the pool pages kv_pages[b]. New token i sits at position start + i and sees the
// keys 0..start+i. torch's SDPA needs the context gathered and padded with a mask, and on CPU
// its causal bf16 kernel reaches ~60 GFLOP/s here; this kernel is flash-attention style:
//   1. pack each (request, KV head)'s K and V once into the layouts VDPBF16PS wants
//      (two bf16 products summed into a float lane per instruction, 32 per vector);
//   2. per tile of kBQ tokens x the G query heads sharing that KV head, walk the key blocks of
//      kBK up to the diagonal: scores in float, online softmax (running max and sum per query
//      row), probabilities rounded to bf16 (as torch's CPU flash attention does), P.V
//      accumulated in float.
// A query row's arithmetic depends only on its position and context, never on the tile, the
// chunk or the batch it comes in: key blocks always start at position 0 and masked keys add
// an exact 0. So a prompt prefilled in one piece or in chunks gets the same bits.
//
// Shapes: T tokens, H / Hkv query / KV heads (G = H / Hkv), D head dim (% 16 == 0, <= 256),
// B requests, P pages per request, ps page size; pools [slots, Hkv, D].
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kBQ = 16;  // query tokens per tile
constexpr int64_t kBK = 64;  // keys per block: 4 vectors of 16 lanes
constexpr int64_t kR = 4;    // query rows per register tile
using bf16 = c10::BFloat16;

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
inline __m512i bcast_pair(const uint16_t* p) {  // two adjacent bf16 into every 32-bit lane
  int32_t x;
  std::memcpy(&x, p, sizeof(x));
  return _mm512_set1_epi32(x);
}

struct Packed {  // one (request, KV head); len_pad keys, a multiple of kBK, zero padded
  std::vector<uint16_t> k;  // [len_pad / 16][D / 2][16][2]: vector (key block, dim pair)
  std::vector<uint16_t> v;  // [len_pad / 2][D][2]: vector (key pair, 16 dims)
};

void pack(const bf16* kb, const bf16* vb, const int64_t* pages, int64_t len, int64_t ps,
          int64_t tok, int64_t off, int64_t D, Packed& out) {
  const int64_t len_pad = (len + kBK - 1) / kBK * kBK;
  out.k.assign(len_pad * D, 0);
  out.v.assign(len_pad * D, 0);
  for_each_slot(kb, pages, len, ps, tok, off, [&](int64_t j, const bf16* k) {
    const auto* kr = reinterpret_cast<const uint16_t*>(k);
    uint16_t* dst = out.k.data() + (j / 16) * D * 16 + (j % 16) * 2;
    for (int64_t d = 0; d < D; d += 2) {
      dst[d * 16] = kr[d];  // vector d / 2 of this key block: 32 lanes apart per pair
      dst[d * 16 + 1] = kr[d + 1];
    }
  });
  for_each_slot(vb, pages, len, ps, tok, off, [&](int64_t j, const bf16* v) {
    const auto* vr = reinterpret_cast<const uint16_t*>(v);
    uint16_t* dst = out.v.data() + (j / 2) * D * 2 + (j % 2);
    for (int64_t d = 0; d < D; ++d) dst[d * 2] = vr[d];
  });
}

struct Tile {  // kBQ tokens of one request x the G heads of one KV head
  int64_t b, hk, i0, i1;
};

// Per-thread scratch of one tile: rows = tokens x G heads, padded to kR.
struct Scratch {
  std::vector<uint16_t> q;  // [rows][D] bf16 bits
  std::vector<float> s;     // [rows][kBK] scores
  std::vector<uint16_t> p;  // [rows][kBK] probabilities, bf16 bits
  std::vector<float> o;     // [rows][D] unnormalised output
  std::vector<float> m, l, alpha;
};

// s[r][0..kBK) = scale * q_r . k_j for the keys of block kb, kR rows at a time.
void scores(const Scratch& w, const uint16_t* kp, int64_t kb, int64_t rows, int64_t D,
            float scale, float* s) {
  for (int64_t r0 = 0; r0 < rows; r0 += kR) {
    __m512 acc[kR][4];
    for (auto& a : acc)
      for (auto& x : a) x = _mm512_setzero_ps();
    const uint16_t* kblk = kp + kb * 4 * D * 16;  // 4 vectors of 16 keys, D / 2 pairs each
    for (int64_t pr = 0; pr < D / 2; ++pr) {
      __m512i kv[4];
      for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_si512(kblk + (c * D / 2 + pr) * 32);
      for (int64_t r = 0; r < kR; ++r) {
        const __m512i qb = bcast_pair(w.q.data() + (r0 + r) * D + 2 * pr);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(kv[c]),
                                                                 as_bh(qb));
      }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < kR; ++r)
      for (int c = 0; c < 4; ++c)
        _mm512_storeu_ps(s + (r0 + r) * kBK + c * 16, _mm512_mul_ps(acc[r][c], sc));
  }
}

// Online softmax of one row's block: keys past `last` masked; updates m and l, writes the
// bf16 probabilities and the factor alpha that rescales the row's earlier output.
void softmax_row(const float* s, int64_t k0, int64_t last, float& m, float& l, float& alpha,
                 uint16_t* p) {
  const int64_t n = std::clamp<int64_t>(last - k0 + 1, 0, kBK);  // keys visible in the block
  if (n == 0) {  // the whole block lies past this row's position
    alpha = 1.f;
    std::memset(p, 0, kBK * sizeof(uint16_t));
    return;
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __mmask16 vis[4];  // visible lanes of each vector
  __m512 x[4], mx = _mm512_set1_ps(-INFINITY);
  for (int c = 0; c < 4; ++c) {
    vis[c] = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(c * 16)),
                                     _mm512_set1_epi32(static_cast<int32_t>(n)));
    x[c] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis[c], _mm512_loadu_ps(s + c * 16));
    mx = _mm512_max_ps(mx, x[c]);
  }
  const float mn = std::max(m, _mm512_reduce_max_ps(mx));
  alpha = std::exp(m - mn);  // m = -inf on the first block: alpha = 0
  v16 sum{};
  for (int c = 0; c < 4; ++c) {
    v16 e = vexp(x[c] - mn);
    e = _mm512_maskz_mov_ps(vis[c], e);  // masked: an exact 0, not exp(-88)
    sum += e;
    store16(reinterpret_cast<bf16*>(p + c * 16), e);
  }
  m = mn;
  l = l * alpha + _mm512_reduce_add_ps(sum);
}

// o[r] = o[r] * alpha[r] + P[r] . V over the block's keys, kR rows x 4 vectors of dims.
void accumulate(Scratch& w, const uint16_t* vp, int64_t kb, int64_t rows, int64_t D,
                int64_t pairs) {
  for (int64_t r0 = 0; r0 < rows; r0 += kR) {
    for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {
      const int nc = static_cast<int>(std::min<int64_t>(4, D / 16 - c0));
      __m512 acc[kR][4];
      for (int64_t r = 0; r < kR; ++r) {
        const __m512 a = _mm512_set1_ps(w.alpha[r0 + r]);
        for (int c = 0; c < nc; ++c)
          acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + (r0 + r) * D + (c0 + c) * 16),
                                    a);
      }
      const uint16_t* vblk = vp + kb * kBK * D;
      for (int64_t jp = 0; jp < pairs; ++jp) {
        __m512i vv[4];
        for (int c = 0; c < nc; ++c)
          vv[c] = _mm512_loadu_si512(vblk + (jp * D + (c0 + c) * 16) * 2);
        for (int64_t r = 0; r < kR; ++r) {
          const __m512i pb = bcast_pair(w.p.data() + (r0 + r) * kBK + 2 * jp);
          for (int c = 0; c < nc; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(vv[c]),
                                                                    as_bh(pb));
        }
      }
      for (int64_t r = 0; r < kR; ++r)
        for (int c = 0; c < nc; ++c)
          _mm512_storeu_ps(w.o.data() + (r0 + r) * D + (c0 + c) * 16, acc[r][c]);
    }
  }
}

void run_tile(const Tile& t, const Packed& pk, const bf16* qp, int64_t qrow, int64_t G,
              int64_t D, int64_t start, float scale, bf16* op, int64_t orow, Scratch& w) {
  const int64_t rows = (t.i1 - t.i0) * G, rpad = (rows + kR - 1) / kR * kR;
  w.q.assign(rpad * D, 0);
  w.s.resize(rpad * kBK);
  w.p.assign(rpad * kBK, 0);
  w.o.assign(rpad * D, 0.f);
  w.m.assign(rpad, -INFINITY);
  w.l.assign(rpad, 0.f);
  w.alpha.assign(rpad, 1.f);
  for (int64_t r = 0; r < rows; ++r)  // row r: token i0 + r / G, head hk * G + r % G
    std::memcpy(w.q.data() + r * D, qp + (t.i0 + r / G) * qrow + (t.hk * G + r % G) * D,
                D * sizeof(bf16));
  const int64_t last_key = start + t.i1 - 1;
  for (int64_t kb = 0; kb * kBK <= last_key; ++kb) {
    const int64_t k0 = kb * kBK;
    scores(w, pk.k.data(), kb, rpad, D, scale, w.s.data());
    for (int64_t r = 0; r < rows; ++r)
      softmax_row(w.s.data() + r * kBK, k0, start + t.i0 + r / G, w.m[r], w.l[r], w.alpha[r],
                  w.p.data() + r * kBK);
    const int64_t pairs = (std::min(kBK, last_key - k0 + 1) + 1) / 2;
    accumulate(w, pk.v.data(), kb, rpad, D, pairs);
  }
  for (int64_t r = 0; r < rows; ++r) {
    bf16* o = op + (t.i0 + r / G) * orow + (t.hk * G + r % G) * D;
    const float inv = 1.f / w.l[r];
    for (int64_t c = 0; c < D; c += 16) store16(o + c, load16(w.o.data() + r * D + c) * inv);
  }
}

void extend_impl(const at::Tensor& q, const at::Tensor& kbuf, const at::Tensor& vbuf,
                 const at::Tensor& table, const std::vector<int64_t>& starts,
                 const std::vector<int64_t>& lens, int64_t ps, double scale, at::Tensor& out) {
  const int64_t B = static_cast<int64_t>(lens.size()), H = q.size(1), D = q.size(2);
  const int64_t Hkv = kbuf.size(1), G = H / Hkv, P = table.size(1), tok = Hkv * D;
  const auto* tp = table.data_ptr<int64_t>();
  std::vector<int64_t> first(B + 1, 0);  // row b's tokens: [first[b], first[b + 1])
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + lens[b];
  std::vector<Packed> packed(B * Hkv);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b0, int64_t e0) {
    for (int64_t x = b0; x < e0; ++x) {
      const int64_t b = x / Hkv, hk = x % Hkv;
      pack(kbuf.data_ptr<bf16>(), vbuf.data_ptr<bf16>(), tp + b * P, starts[b] + lens[b], ps,
           tok, hk * D, D, packed[x]);
    }
  });
  std::vector<Tile> tiles;  // the longest contexts first: the dynamic schedule balances
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i0 = (lens[b] - 1) / kBQ * kBQ; i0 >= 0; i0 -= kBQ)
      for (int64_t hk = 0; hk < Hkv; ++hk)
        tiles.push_back({b, hk, i0, std::min(i0 + kBQ, lens[b])});
  std::stable_sort(tiles.begin(), tiles.end(), [&](const Tile& a, const Tile& c) {
    return starts[a.b] + a.i1 > starts[c.b] + c.i1;
  });
  const auto* qp = q.data_ptr<bf16>();
  auto* op = out.data_ptr<bf16>();
  const int64_t n = static_cast<int64_t>(tiles.size());
  const float sc = static_cast<float>(scale);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t x = 0; x < n; ++x) {
      const Tile& t = tiles[x];
      run_tile(t, packed[t.b * Hkv + t.hk], qp + first[t.b] * q.stride(0), q.stride(0), G, D,
               starts[t.b], sc, op + first[t.b] * H * D, H * D, w);
    }
  }
}
#endif

}  // namespace

bool has_extend_attention() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// q [T, H, D] bf16 (heads contiguous, any row stride); returns [T, H * D].
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& kv_pages, const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& q_lens, int64_t page_size, double scale) {
  TORCH_CHECK(has_extend_attention(), "extend_attention: needs a CPU with AVX512-BF16");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 &&
                  k_buf.scalar_type() == at::kBFloat16 && v_buf.scalar_type() == at::kBFloat16,
              "extend_attention: bfloat16 CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [T, H, D] with contiguous heads");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 256,
              "extend_attention: head_dim % 16, <= 256");
  TORCH_CHECK(starts.size() == q_lens.size() && kv_pages.size(0) >= (int64_t)q_lens.size(),
              "extend_attention: one start, length and page row per request");
  int64_t total = 0;
  for (size_t b = 0; b < q_lens.size(); ++b) {
    TORCH_CHECK(q_lens[b] > 0 && starts[b] >= 0, "extend_attention: bad start or length");
    TORCH_CHECK(starts[b] + q_lens[b] <= kv_pages.size(1) * page_size,
                "extend_attention: context longer than its page row");
    total += q_lens[b];
  }
  TORCH_CHECK(total == q.size(0), "extend_attention: lengths must sum to q's tokens");
  auto table = kv_pages.to(at::kLong).contiguous();
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
#if defined(__AVX512BF16__)
  extend_impl(q, k_buf, v_buf, table, starts, q_lens, page_size, scale, out);
#endif
  return out;
}
