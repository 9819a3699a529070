// Decode attention on AVX2 CPUs without AVX-512 (docs/architecture.md: "Engine speed"), for
// float32 and bfloat16 pools: one new token per request over its whole context, read from
// the paged pool in place, the same arithmetic as cpu_ops.cpp's portable `decode_attention`
// (float products and sums, the same softmax) in an order that suits 16 ymm registers.
// The portable kernel keeps [G][D/16] 16-float vectors indexed at run time, which AVX2 can
// only hold in memory, and sums each score's 16 lanes on its own; that ran at a quarter of
// the memory bandwidth on a 2-core EPYC. Here:
//   - scores, 8 keys at a time: each key's D/8 products summed lane-wise (the query head in
//     registers), then one transposed tree of VHADDPS turns the 8 vectors into 8 scores;
//   - P.V, one query head at a time: D/8 accumulators in registers, a key per step (the
//     value rows of the other heads of the KV head come from the cache).
// A task is one (request, KV head), as in the portable kernel: the bits of a row do not
// depend on the batch around it.
//
// Shapes: q [B, H, D] (heads contiguous); pools [slots, Hkv, D]; table [B, P] pages;
// lens [B] context length incl. the new token; out [B, H, D]. D % 8 == 0, D <= 256.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PD_DECODE_AVX2 1
#include <immintrin.h>
#else
#define PD_DECODE_AVX2 0
#endif

namespace {

#if PD_DECODE_AVX2
constexpr int64_t kMaxC = 32;  // D / 8 vectors of a head

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// r[j] = sum of the 8 lanes of a[j], j < 8: pairs and quads within 128-bit lanes (VHADDPS),
// then the two halves.
inline __m256 reduce8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);
  // lo = [a0..a3 low-half sums | a0..a3 high-half sums], hi the same for a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                       _mm256_permute2f128_ps(lo, hi, 0x31));
}

// s[t] = q . k_t for t < len, k_t = rows[t] + off; q (already scaled) is C vectors.
template <int C, typename T>
void scores_c(const __m256* qin, const T* const* rows, int64_t off, int64_t len, float* s) {
  __m256 q[C];
  for (int c = 0; c < C; ++c) q[c] = qin[c];
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - t0);
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) {  // past the end: the first key again, result dropped
      const T* k = rows[t0 + (j < n ? j : 0)] + off;
      acc[j] = _mm256_mul_ps(q[0], load8(k));
      for (int c = 1; c < C; ++c) acc[j] = _mm256_fmadd_ps(q[c], load8(k + 8 * c), acc[j]);
    }
    const __m256 r = reduce8(acc);
    if (n == 8) {
      _mm256_storeu_ps(s + t0, r);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, r);
      for (int64_t j = 0; j < n; ++j) s[t0 + j] = tmp[j];
    }
  }
}

// out[d] = sum_t p[t] * v_t[d] for d < 8 C, v_t = rows[t] + off.
template <int C, typename T>
void values_c(const float* p, const T* const* rows, int64_t off, int64_t len, float* out) {
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const __m256 pb = _mm256_broadcast_ss(p + t);
    const T* v = rows[t] + off;
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(pb, load8(v + 8 * c), acc[c]);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

template <typename T>
struct HeadFns {
  void (*scores)(const __m256*, const T* const*, int64_t, int64_t, float*);
  void (*values)(const float*, const T* const*, int64_t, int64_t, float*);
};

template <typename T>
HeadFns<T> head_fns(int64_t C) {
  switch (C) {  // the head dims models use: 32, 64, 80, 96, 128, 256
    case 4: return {&scores_c<4, T>, &values_c<4, T>};
    case 8: return {&scores_c<8, T>, &values_c<8, T>};
    case 10: return {&scores_c<10, T>, &values_c<10, T>};
    case 12: return {&scores_c<12, T>, &values_c<12, T>};
    case 16: return {&scores_c<16, T>, &values_c<16, T>};
    case 32: return {&scores_c<32, T>, &values_c<32, T>};
  }
  return {nullptr, nullptr};
}

template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                 const at::Tensor& table, const at::Tensor& lens, at::Tensor& out, int64_t ps,
                 double scale) {
  const int64_t B = out.size(0), H = out.size(1), D = out.size(2);
  const int64_t Hkv = kb.size(1), G = H / Hkv, P = table.size(1), C = D / 8;
  const int64_t qrow = q.stride(0), tok = Hkv * D;  // pool stride of one token slot
  const T* qp = q.data_ptr<T>();
  const T* kp = kb.data_ptr<T>();
  const T* vp = vb.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const HeadFns<T> fn = head_fns<T>(C);
  const __m256 sc = _mm256_set1_ps(static_cast<float>(scale));
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b0, int64_t e0) {
    std::vector<const T*> krows, vrows;  // each context position's token slot
    std::vector<float> s;                // one head's scores, then probabilities
    __m256 qv[kMaxC];
    alignas(32) float o[8 * kMaxC];
    for (int64_t task = b0; task < e0; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv, len = lp[b];
      const int64_t* pages = tp + b * P;
      krows.resize(len);
      vrows.resize(len);
      for_each_slot(kp, pages, len, ps, tok, 0, [&](int64_t t, const T* r) { krows[t] = r; });
      for_each_slot(vp, pages, len, ps, tok, 0, [&](int64_t t, const T* r) { vrows[t] = r; });
      s.resize(len);
      for (int64_t g = 0; g < G; ++g) {
        const T* qh = qp + b * qrow + (hk * G + g) * D;
        for (int64_t c = 0; c < C; ++c) qv[c] = _mm256_mul_ps(load8(qh + 8 * c), sc);
        fn.scores(qv, krows.data(), hk * D, len, s.data());
        const float inv = exp_normaliser(s.data(), len);
        fn.values(s.data(), vrows.data(), hk * D, len, o);
        T* dst = op + (b * H + hk * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = r<T>(o[d] * inv);
      }
    }
  });
}
#endif

}  // namespace

// True when this build has the kernel and it serves these heads (else: cpu_ops.cpp's).
bool decode_avx2_serves(int64_t H, int64_t Hkv, int64_t D) {
#if PD_DECODE_AVX2
  const int64_t C = D / 8;
  return D % 8 == 0 && H % Hkv == 0 &&
         (C == 4 || C == 8 || C == 10 || C == 12 || C == 16 || C == 32);
#else
  (void)H, (void)Hkv, (void)D;
  return false;
#endif
}

void decode_attention_avx2(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& table, const at::Tensor& lens, at::Tensor& out,
                           int64_t page_size, double scale) {
#if PD_DECODE_AVX2
  if (q.scalar_type() == at::kBFloat16)
    decode_impl<c10::BFloat16>(q, k_buf, v_buf, table, lens, out, page_size, scale);
  else
    decode_impl<float>(q, k_buf, v_buf, table, lens, out, page_size, scale);
#else
  (void)q, (void)k_buf, (void)v_buf, (void)table, (void)lens, (void)out, (void)page_size,
      (void)scale;
  TORCH_CHECK(false, "decode_attention_avx2: built without AVX2 (or with AVX-512)");
#endif
}
