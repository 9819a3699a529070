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
// A row whose tile fits one register group (new tokens x G <= kR: a decode row served as a
// one-token prompt row, as `--enable-deterministic-inference` does) reads each key once, so
// packing would copy the context only to read it once: such rows build the same vectors
// straight from the pool (`PoolKV`: a gather per K vector, an interleave per V vector) and
// run the same instructions on them, hence the same bits.
// Where the build has AMX, the OS grants it and D % 32 == 0, both products run on AMX tiles
// instead (amx.h; `scores_amx`, `accumulate_amx`): the packed layouts above are the tiles'
// operand layouts, rows are padded to 16, and in-place rows first build the same blocks, so
// the invariance above holds there too (with other bits than the VDPBF16PS path).
//
// Shapes: T tokens, H / Hkv query / KV heads (G = H / Hkv), D head dim (% 16 == 0, <= 256),
// B requests, P pages per request, ps page size; pools [slots, Hkv, D].
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "amx.h"
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

// exp(x) for the softmax numerators, which are rounded to bf16 (8 significant bits): 2^n * 2^f
// with n = round(x log2 e), |f| <= 1/2, 2^f by its degree-4 Taylor polynomial (relative
// error < 5e-5, far below bf16's 2^-9), scaled by VSCALEFPS. x clamped to >= -87 (-inf
// gives ~1e-38, not NaN, and no subnormal: those cost microcode assists). A third of vec.h's
// float-exact vexp.
inline __m512 exp_bf16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)),
                                 _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
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

// The vectors the dot products read, from the packed copies (layouts above).
struct PackedKV {
  const uint16_t* k;
  const uint16_t* v;
  int64_t D;
  // K vector c of key block kb, dim pair pr: 16 keys' (2 pr, 2 pr + 1)
  __m512i kvec(int64_t kb, int c, int64_t pr) const {
    return _mm512_loadu_si512(k + ((kb * 4 + c) * (D / 2) + pr) * 32);
  }
  // V vector of key pair jp of block kb, dims 16 cc..16 cc + 15: (key 2 jp, key 2 jp + 1)
  __m512i vvec(int64_t kb, int64_t jp, int64_t cc) const {
    return _mm512_loadu_si512(v + kb * kBK * D + (jp * D + cc * 16) * 2);
  }
  // Block kb whole, for AMX: K [4][D / 2][16][2] and V [kBK / 2][D][2], read in place.
  const uint16_t* kblock(int64_t kb, std::vector<uint16_t>&) const { return k + kb * kBK * D; }
  const uint16_t* vblock(int64_t kb, std::vector<uint16_t>&) const { return v + kb * kBK * D; }
};

// The same vectors built from the pool in place; keys past the context read as 0, like the
// packed copies' padding. at[j]: key j's row, counted in 32-bit units from the buffer start.
struct PoolKV {
  const int32_t* k;  // the K buffer as pairs of bf16
  const uint16_t* v;
  const int32_t* at;  // [len_pad], -1 past the context
  int64_t D;
  __m512i kvec(int64_t kb, int c, int64_t pr) const {
    const __m512i idx = _mm512_loadu_si512(at + kb * kBK + c * 16);
    const __mmask16 in = _mm512_cmpge_epi32_mask(idx, _mm512_setzero_si512());
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in,
                                       _mm512_add_epi32(idx, _mm512_set1_epi32((int32_t)pr)),
                                       k, 4);
  }
  __m512i vvec(int64_t kb, int64_t jp, int64_t cc) const {
    const int64_t j = kb * kBK + 2 * jp;
    const __m256i zero = _mm256_setzero_si256();
    const __m256i a = at[j] < 0 ? zero : _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(v + 2 * (int64_t)at[j] + cc * 16));
    const __m256i b = at[j + 1] < 0 ? zero : _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(v + 2 * (int64_t)at[j + 1] + cc * 16));
    // lanes (a0, b0, a1, b1, ...): the packed V layout
    const __m512i mix = _mm512_set_epi16(
        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), mix,
                                     _mm512_castsi256_si512(b));
  }
  // Block kb whole in PackedKV's layouts, built in `buf` from the vectors above.
  const uint16_t* kblock(int64_t kb, std::vector<uint16_t>& buf) const {
    buf.resize(kBK * D);
    for (int c = 0; c < 4; ++c)
      for (int64_t pr = 0; pr < D / 2; ++pr)
        _mm512_storeu_si512(buf.data() + (c * (D / 2) + pr) * 32, kvec(kb, c, pr));
    return buf.data();
  }
  const uint16_t* vblock(int64_t kb, std::vector<uint16_t>& buf) const {
    buf.resize(kBK * D);
    for (int64_t jp = 0; jp < kBK / 2; ++jp)
      for (int64_t cc = 0; cc < D / 16; ++cc)
        _mm512_storeu_si512(buf.data() + (jp * D + cc * 16) * 2, vvec(kb, jp, cc));
    return buf.data();
  }
};

// Row offsets of a context's keys for PoolKV (in 32-bit units: slot * tok + off is even).
void key_rows(const int64_t* pages, int64_t len, int64_t ps, int64_t tok, int64_t off,
              std::vector<int32_t>& at) {
  at.assign((len + kBK - 1) / kBK * kBK + 2, -1);  // +2: vvec's pair past an odd end
  for (int64_t j = 0; j < len; ++j)
    at[j] = static_cast<int32_t>((pages[j / ps] * ps * tok + (j % ps) * tok + off) / 2);
}

// Whether a head dim of D runs on AMX tiles here: built with AMX, granted by the OS, D % 32.
bool use_amx(int64_t D) {
#if defined(PDSERVE_AMX)
  return D % 32 == 0 && amx::ready();
#else
  (void)D;
  return false;
#endif
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
  std::vector<float> m, l16, alpha;  // per row: running max, running sum (16 lanes)
  std::vector<int64_t> last;         // per row: its last visible key (-1: a padding row)
  std::vector<int32_t> at;           // PoolKV's key rows
  std::vector<uint16_t> kblk, vblk;  // PoolKV's block for the AMX products
};

// s[r][0..kBK) = scale * q_r . k_j for the keys of block kb, kR rows at a time.
template <class KV>
void scores(const Scratch& w, const KV& src, int64_t kb, int64_t rows, int64_t D,
            float scale, float* s) {
  for (int64_t r0 = 0; r0 < rows; r0 += kR) {
    __m512 acc[kR][4];
    for (auto& a : acc)
      for (auto& x : a) x = _mm512_setzero_ps();
    for (int64_t pr = 0; pr < D / 2; ++pr) {
      __m512i kv[4];  // 4 vectors of 16 keys
      for (int c = 0; c < 4; ++c) kv[c] = src.kvec(kb, c, pr);
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

// Online softmax of kR rows' block at once (their dependency chains interleave): row r sees
// the keys up to last[r] (none: p = 0, alpha = 1). Updates each row's running max m and the
// 16 lanes of its running sum l16 (reduced once at the end), writes its bf16 probabilities
// and the factor alpha that rescales its earlier output.
void softmax_rows(const float* s, int64_t k0, const int64_t* last, float* m, float* l16,
                  float* alpha, uint16_t* p) {
  __mmask16 vis[kR][4];  // visible lanes of each vector
  __m512 x[kR][4];
  float mb[kR];
  for (int64_t r = 0; r < kR; ++r) {
    const int64_t n = last[r] - k0 + 1;  // keys visible in the block (<= 0: none)
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; ++c) {
      const int64_t k = n - 16 * c;
      vis[r][c] = _cvtu32_mask16(k >= 16 ? 0xFFFFu : k <= 0 ? 0u : (1u << k) - 1u);
      x[r][c] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), vis[r][c], s + r * kBK + c * 16);
      mx = _mm512_max_ps(mx, x[r][c]);
    }
    mb[r] = _mm512_reduce_max_ps(mx);
  }
  // a new maximum rescales what came before (m = -inf on the first block: alpha ~ 0)
  alignas(64) float d[16] = {};
  for (int64_t r = 0; r < kR; ++r) d[r] = mb[r] > m[r] ? m[r] - mb[r] : 0.f;
  alignas(64) float e[16];
  _mm512_store_ps(e, exp_bf16(_mm512_load_ps(d)));  // exp(0) is exactly 1
  for (int64_t r = 0; r < kR; ++r) {
    alpha[r] = e[r];
    m[r] = std::max(m[r], mb[r]);
    const __m512 mv = _mm512_set1_ps(m[r]);
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l16 + r * 16), _mm512_set1_ps(alpha[r]));
    for (int c = 0; c < 4; ++c) {
      // masked: an exact 0 (also where m is still -inf and x - m is NaN)
      x[r][c] = _mm512_maskz_mov_ps(vis[r][c], exp_bf16(_mm512_sub_ps(x[r][c], mv)));
      sum = _mm512_add_ps(sum, x[r][c]);
    }
    for (int c = 0; c < 4; c += 2)  // rounded to bf16 (nearest even), two vectors at a time
      _mm512_storeu_si512(p + r * kBK + c * 16,
                          (__m512i)_mm512_cvtne2ps_pbh(x[r][c + 1], x[r][c]));
    _mm512_storeu_ps(l16 + r * 16, sum);
  }
}

// o[r] = o[r] * alpha[r] + P[r] . V over the block's first 2 * `pairs` keys, for kR rows and
// NC vectors of 16 dims from vector c0 (NC a constant: the accumulators stay in registers).
template <int NC, class KV>
void accumulate_dims(Scratch& w, const KV& src, int64_t kb, int64_t r0, int64_t c0, int64_t D,
                     int64_t pairs) {
  __m512 acc[kR][NC];
  for (int64_t r = 0; r < kR; ++r) {
    const __m512 a = _mm512_set1_ps(w.alpha[r0 + r]);
    for (int c = 0; c < NC; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + (r0 + r) * D + (c0 + c) * 16), a);
  }
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512i vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = src.vvec(kb, jp, c0 + c);
    for (int64_t r = 0; r < kR; ++r) {
      const __m512i pb = bcast_pair(w.p.data() + (r0 + r) * kBK + 2 * jp);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(vv[c]),
                                                                as_bh(pb));
    }
  }
  for (int64_t r = 0; r < kR; ++r)
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(w.o.data() + (r0 + r) * D + (c0 + c) * 16, acc[r][c]);
}

template <class KV>
void accumulate(Scratch& w, const KV& src, int64_t kb, int64_t rows, int64_t D,
                int64_t pairs) {
  for (int64_t r0 = 0; r0 < rows; r0 += kR)
    for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {
      switch (std::min<int64_t>(4, D / 16 - c0)) {
        case 4: accumulate_dims<4>(w, src, kb, r0, c0, D, pairs); break;
        case 3: accumulate_dims<3>(w, src, kb, r0, c0, D, pairs); break;
        case 2: accumulate_dims<2>(w, src, kb, r0, c0, D, pairs); break;
        default: accumulate_dims<1>(w, src, kb, r0, c0, D, pairs); break;
      }
    }
}

#if defined(PDSERVE_AMX)
// The AMX forms of scores() and accumulate(): rows a multiple of 16, D of 32.
template <class KV>
void scores_amx(Scratch& w, const KV& src, int64_t kb, int64_t rows, int64_t D, float scale) {
  const uint16_t* k = src.kblock(kb, w.kblk);
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    amx::scores16(w.q.data() + r0 * D, D, k, w.s.data() + r0 * kBK, kBK);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < rows * kBK; i += 16)
    _mm512_storeu_ps(w.s.data() + i, _mm512_mul_ps(_mm512_loadu_ps(w.s.data() + i), sc));
}

// Key halves past the last visible one are skipped: their probabilities are exact zeros,
// which would add nothing.
template <class KV>
void accumulate_amx(Scratch& w, const KV& src, int64_t kb, int64_t rows, int64_t D,
                    int64_t pairs) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 a = _mm512_set1_ps(w.alpha[r]);
    float* o = w.o.data() + r * D;
    for (int64_t c = 0; c < D; c += 16)
      _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), a));
  }
  const uint16_t* v = src.vblock(kb, w.vblk);
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    amx::accumulate16(w.p.data() + r0 * kBK, kBK, v, D, pairs > 16 ? 2 : 1,
                      w.o.data() + r0 * D);
}
#endif

// `amx`: the products on AMX tiles (rows padded to 16) instead of VDPBF16PS.
template <class KV>
void run_tile(const Tile& t, const KV& src, const bf16* qp, int64_t qrow, int64_t G,
              int64_t D, int64_t start, float scale, bf16* op, int64_t orow, Scratch& w,
              bool amx) {
  const int64_t pad = amx ? 16 : kR;
  const int64_t rows = (t.i1 - t.i0) * G, rpad = (rows + pad - 1) / pad * pad;
  w.q.assign(rpad * D, 0);
  w.s.resize(rpad * kBK);
  w.p.assign(rpad * kBK, 0);
  w.o.assign(rpad * D, 0.f);
  w.m.assign(rpad, -INFINITY);
  w.l16.assign(rpad * 16, 0.f);
  w.alpha.assign(rpad, 1.f);
  w.last.assign(rpad, -1);
  for (int64_t r = 0; r < rows; ++r) w.last[r] = start + t.i0 + r / G;
  for (int64_t r = 0; r < rows; ++r)  // row r: token i0 + r / G, head hk * G + r % G
    std::memcpy(w.q.data() + r * D, qp + (t.i0 + r / G) * qrow + (t.hk * G + r % G) * D,
                D * sizeof(bf16));
  const int64_t last_key = start + t.i1 - 1;
  for (int64_t kb = 0; kb * kBK <= last_key; ++kb) {
    const int64_t k0 = kb * kBK;
#if defined(PDSERVE_AMX)
    if (amx) scores_amx(w, src, kb, rpad, D, scale);
    else
#endif
      scores(w, src, kb, rpad, D, scale, w.s.data());
    for (int64_t r = 0; r < rpad; r += kR)
      softmax_rows(w.s.data() + r * kBK, k0, w.last.data() + r, w.m.data() + r,
                   w.l16.data() + r * 16, w.alpha.data() + r, w.p.data() + r * kBK);
    const int64_t pairs = (std::min(kBK, last_key - k0 + 1) + 1) / 2;
#if defined(PDSERVE_AMX)
    if (amx) accumulate_amx(w, src, kb, rpad, D, pairs);
    else
#endif
      accumulate(w, src, kb, rpad, D, pairs);
  }
  for (int64_t r = 0; r < rows; ++r) {
    bf16* o = op + (t.i0 + r / G) * orow + (t.hk * G + r % G) * D;
    const float inv = 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(w.l16.data() + r * 16));
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
  // in place: one register group per tile, and offsets that fit PoolKV's int32 gather
  const bool fits = kbuf.numel() / 2 < (int64_t{1} << 31) - 1;
  std::vector<char> in_place(B);
  for (int64_t b = 0; b < B; ++b) in_place[b] = fits && lens[b] * G <= kR;
  std::vector<Packed> packed(B * Hkv);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b0, int64_t e0) {
    for (int64_t x = b0; x < e0; ++x) {
      const int64_t b = x / Hkv, hk = x % Hkv;
      if (in_place[b]) continue;
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
  const bool amx = use_amx(D);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch w;
#if defined(PDSERVE_AMX)
    if (amx) amx::configure();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t x = 0; x < n; ++x) {
      const Tile& t = tiles[x];
      const bf16* qt = qp + first[t.b] * q.stride(0);
      bf16* ot = op + first[t.b] * H * D;
      if (in_place[t.b]) {
        key_rows(tp + t.b * P, starts[t.b] + lens[t.b], ps, tok, t.hk * D, w.at);
        const PoolKV src{reinterpret_cast<const int32_t*>(kbuf.data_ptr<bf16>()),
                         reinterpret_cast<const uint16_t*>(vbuf.data_ptr<bf16>()),
                         w.at.data(), D};
        run_tile(t, src, qt, q.stride(0), G, D, starts[t.b], sc, ot, H * D, w, amx);
      } else {
        const Packed& pk = packed[t.b * Hkv + t.hk];
        run_tile(t, PackedKV{pk.k.data(), pk.v.data(), D}, qt, q.stride(0), G, D, starts[t.b],
                 sc, ot, H * D, w, amx);
      }
    }
#if defined(PDSERVE_AMX)
    if (amx) amx::release();
#endif
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

// Whether extend_attention's products run on AMX tiles for this head dim (else VDPBF16PS).
bool extend_attention_amx(int64_t head_dim) {
#if defined(__AVX512BF16__)
  return use_amx(head_dim);
#else
  (void)head_dim;
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
