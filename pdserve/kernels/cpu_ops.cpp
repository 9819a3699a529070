// Fused CPU kernels for the decoder layer (docs/architecture.md: "Engine speed").
//
// Eager PyTorch spends most of a small decode step on op dispatch and on copies: an RMSNorm is
// eight ops, rope five, and attention over the paged pool first gathers every context into a
// padded tensor that SDPA then reads again. These kernels do each of those in one pass. Every
// element-wise result is rounded to the tensor dtype at the same points as the torch reference
// in pdserve/models/ops.py (and HF's modelling code), so float32 stays exact against
// transformers up to reduction order, and bfloat16 rounds where HF rounds.
//
// Shapes: T tokens, H query heads, Hkv KV heads (G = H / Hkv query heads share one), D head
// dim, B requests, P pages per request, ps page size.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

// out[t] = w * T(x[t] * rsqrt(mean(x[t]^2) + eps)), computed in float like HF's RMSNorm.
template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += f(x[i]) * f(x[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)  // the same roundings, 16 lanes at a time
    store16(out + i, load16(w + i) * round_as(load16(x + i) * inv, x));
  for (; i < n; ++i) out[i] = r<T>(f(w[i]) * f(r<T>(f(x[i]) * inv)));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) rms_row(xp + i * n, wp, op + i * n, n, (float)eps);
  });
}

// residual += x (rounded), then out = rms_norm(residual): HF's `h = residual + x` followed by
// the next norm, in one pass over the row.
template <typename T>
void add_rms_norm_impl(const at::Tensor& x, at::Tensor& res, const at::Tensor& w,
                       at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = res.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      T* row = rp + i * n;
      const T* xr = xp + i * n;
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) store16(row + j, load16(row + j) + load16(xr + j));
      for (; j < n; ++j) row[j] = r<T>(f(row[j]) + f(xr[j]));
      rms_row(row, wp, op + i * n, n, (float)eps);
    }
  });
}

// fp-contract=off: x*cos + sw*sin must round after each product like torch's separate ops,
// not fuse into one FMA (float32 bits would differ from the reference).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// Rotates the q and k heads of qkv [T, (H + 2 Hkv) * D] in place (x*cos + swap(x)*sin, sin's
// first half pre-negated, each product rounded like torch), then writes k and v of token t to
// pool slot slots[t] of k_buf / v_buf [slots, Hkv, D].
template <typename T>
void rope_store_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& kb, at::Tensor& vb, const at::Tensor& slots, int64_t H,
                     int64_t Hkv) {
  const int64_t toks = qkv.size(0), D = cos.size(1), half = D / 2;
  const int64_t row = qkv.stride(0);
  T* qp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* kp = kb.data_ptr<T>();
  T* vp = vb.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const bool lanes = half % 16 == 0 && D <= 256;  // whole 16-lane halves: vector path
  at::parallel_for(0, toks, 4, [&](int64_t b, int64_t e) {
    std::vector<float> x(D);
    v16 xv[16];  // one head, D <= 256
    for (int64_t t = b; t < e; ++t) {
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        T* hp = qp + t * row + h * D;
        if (lanes) {  // the same roundings as below, 16 lanes at a time
          for (int64_t i = 0; i < D; i += 16) xv[i / 16] = load16(hp + i);
          for (int64_t i = 0; i < D; i += 16) {
            const v16 sw = xv[(i < half ? i + half : i - half) / 16];
            store16(hp + i, round_as(xv[i / 16] * load16(c + i), hp) +
                                round_as(sw * load16(s + i), hp));
          }
          continue;
        }
        for (int64_t i = 0; i < D; ++i) x[i] = f(hp[i]);
        for (int64_t i = 0; i < D; ++i) {
          const float sw = x[i < half ? i + half : i - half];
          hp[i] = r<T>(f(r<T>(x[i] * f(c[i]))) + f(r<T>(sw * f(s[i]))));
        }
      }
      const T* ks = qp + t * row + H * D;  // k then v, each Hkv * D
      std::memcpy(kp + sl[t] * Hkv * D, ks, Hkv * D * sizeof(T));
      std::memcpy(vp + sl[t] * Hkv * D, ks + Hkv * D, Hkv * D * sizeof(T));
    }
  });
}

#pragma GCC pop_options

// out = T(silu(gate)) * up over rows of gate_up [T, 2I] (gate; up), 16 lanes at a time with
// the vectorised exp; rounds where torch's silu then mul round.
template <typename T>
void silu_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t rows = gu.size(0), inter = out.size(1);
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* g = gp + i * 2 * inter;
      const T* u = g + inter;
      T* o = op + i * inter;
      int64_t j = 0;
      for (; j + 16 <= inter; j += 16) {
        const v16 x = load16(g + j);
        const v16 s = round_as(x / (1.f + vexp(-x)), g);
        store16(o + j, s * load16(u + j));
      }
      for (; j < inter; ++j) {
        const float x = f(g[j]);
        o[j] = r<T>(f(r<T>(x / (1.f + std::exp(-x)))) * f(u[j]));
      }
    }
  });
}

// One new token per request attends to its whole context, read in place from the paged pool
// (no gather, no padding). q [B, H, D] (row stride any); pools [slots, Hkv, D]; block_table
// [B, P] pages; seq_lens [B] context length including the new token. One task per (request,
// KV head) computes its G query heads' softmax(q K^T * scale) V in float, 16 lanes at a time
// (D % 16 == 0, checked by the caller). kMaxG bounds the heads sharing one KV head.
constexpr int64_t kMaxG = 16, kMaxC = 16;  // C = D / 16 chunks (D <= 256)

template <typename T>
void decode_attn_impl(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                      const at::Tensor& table, const at::Tensor& lens, at::Tensor& out,
                      int64_t ps, double scale) {
  const int64_t B = out.size(0), H = out.size(1), D = out.size(2);
  const int64_t Hkv = kb.size(1), G = H / Hkv, P = table.size(1), C = D / 16;
  const int64_t qrow = q.stride(0), tok = Hkv * D;  // pool stride of one token slot
  const T* qp = q.data_ptr<T>();
  const T* kp = kb.data_ptr<T>();
  const T* vp = vb.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b0, int64_t e0) {
    v16 qv[kMaxG][kMaxC], acc[kMaxG][kMaxC];
    std::vector<float> s;  // [G, len] scores, then probabilities
    for (int64_t task = b0; task < e0; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv, len = lp[b];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c)
          qv[g][c] = load16(qp + b * qrow + (hk * G + g) * D + c * 16) * sc;
      s.resize(G * len);
      const int64_t* pages = tp + b * P;
      for_each_slot(kp, pages, len, ps, tok, hk * D, [&](int64_t t, const T* k) {
        v16 kc[kMaxC];
        for (int64_t c = 0; c < C; ++c) kc[c] = load16(k + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          v16 d = qv[g][0] * kc[0];
          for (int64_t c = 1; c < C; ++c) d += qv[g][c] * kc[c];
          s[g * len + t] = hsum(d);
        }
      });
      float inv[kMaxG];
      for (int64_t g = 0; g < G; ++g) {
        inv[g] = exp_normaliser(s.data() + g * len, len);
        for (int64_t c = 0; c < C; ++c) acc[g][c] = v16{};
      }
      for_each_slot(vp, pages, len, ps, tok, hk * D, [&](int64_t t, const T* v) {
        v16 vc[kMaxC];
        for (int64_t c = 0; c < C; ++c) vc[c] = load16(v + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * len + t];
          for (int64_t c = 0; c < C; ++c) acc[g][c] += p * vc[c];
        }
      });
      for (int64_t g = 0; g < G; ++g) {
        T* o = op + (b * H + hk * G + g) * D;
        for (int64_t c = 0; c < C; ++c)
          for (int i = 0; i < 16; ++i) o[c * 16 + i] = r<T>(acc[g][c][i] * inv[g]);
      }
    }
  });
}

void check_cpu(const at::Tensor& t, const char* name);
}  // namespace

// decode_bf16.cpp: the AVX512-BF16 decode kernel, used for bf16 where it serves the heads
bool decode_bf16_serves(int64_t H, int64_t Hkv, int64_t D);
void decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& table, const at::Tensor& lens, at::Tensor& out,
                           int64_t page_size, double scale);
// decode_avx2.cpp: the AVX2 decode kernel (builds without AVX-512), float32 and bf16
bool decode_avx2_serves(int64_t H, int64_t Hkv, int64_t D);
void decode_attention_avx2(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& table, const at::Tensor& lens, at::Tensor& out,
                           int64_t page_size, double scale);

namespace {

// y [M, N] = x [M, K] @ w [N, K]^T (+ bias) for bf16 and a few rows (M <= kMaxRows): a decode
// step at low batch is a matrix-vector product whose cost is reading w once; oneDNN's bf16
// GEMM pads such a product to its tile size and reads at half the speed of its float32 GEMV.
// Each output is a float accumulation of exact bf16 products, rounded to bf16 once.
constexpr int64_t kMaxRows = 4;

#if defined(__AVX512BF16__)
#include <immintrin.h>
// 32 products per instruction (VDPBF16PS), no conversion: the fast path on AVX512-BF16 CPUs.
inline void dot_rows(const c10::BFloat16* w, const __m512bh* xv, int64_t M, int64_t K32,
                     float* out) {
  __m512 acc[kMaxRows];
  for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K32; ++k) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k * 32);
    for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], wv, xv[m * K32 + k]);
  }
  for (int64_t m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}
using XVec = __m512bh;
inline XVec load_x(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
#else
// Portable: widen 16 bf16 to float (a shift) and multiply-add in float.
struct XVec {
  v16 lo, hi;
};
inline XVec load_x(const c10::BFloat16* p) { return {load16(p), load16(p + 16)}; }
inline void dot_rows(const c10::BFloat16* w, const XVec* xv, int64_t M, int64_t K32,
                     float* out) {
  v16 acc[kMaxRows];
  for (int64_t m = 0; m < M; ++m) acc[m] = v16{};
  for (int64_t k = 0; k < K32; ++k) {
    const v16 lo = load16(w + k * 32), hi = load16(w + k * 32 + 16);
    for (int64_t m = 0; m < M; ++m) acc[m] += lo * xv[m * K32 + k].lo + hi * xv[m * K32 + k].hi;
  }
  for (int64_t m = 0; m < M; ++m) out[m] = hsum(acc[m]);
}
#endif

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_linear: bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRows && x.size(1) % 32 == 0,
              "small_linear: needs x [M <= 4, K % 32 == 0]");
  TORCH_CHECK(w.is_contiguous() && w.size(1) == x.size(1), "small_linear: w must be [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), K32 = K / 32;
  auto xc = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = bias && bias->defined() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  std::vector<XVec> xv(M * K32);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K32; ++k) xv[m * K32 + k] = load_x(xp + m * K + k * 32);
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    float acc[kMaxRows];
    for (int64_t n = b; n < e; ++n) {
      dot_rows(wp + n * K, xv.data(), M, K32, acc);
      const float add = bp ? static_cast<float>(bp[n]) : 0.f;
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = c10::BFloat16(acc[m] + add);
    }
  });
  return out;
}

#define PD_DISPATCH(dtype, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, NAME, __VA_ARGS__)

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_cpu(x, "x");
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  PD_DISPATCH(x.scalar_type(), "rms_norm", [&] { rms_norm_impl<scalar_t>(xc, w, out, eps); });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                        double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  PD_DISPATCH(x.scalar_type(), "add_rms_norm",
              [&] { add_rms_norm_impl<scalar_t>(xc, residual, w, out, eps); });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  auto gc = gate_up.contiguous();
  auto out = at::empty({gc.size(0), gc.size(1) / 2}, gc.options());
  PD_DISPATCH(gc.scalar_type(), "silu_and_mul", [&] { silu_mul_impl<scalar_t>(gc, out); });
  return out;
}

void rope_and_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& slots, int64_t H,
                    int64_t Hkv) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.stride(1) == 1, "qkv rows must be contiguous");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  auto c = cos.contiguous(), s = sin.contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  PD_DISPATCH(qkv.scalar_type(), "rope_and_store",
              [&] { rope_store_impl<scalar_t>(qkv, c, s, k_buf, v_buf, sl, H, Hkv); });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf,
                            const at::Tensor& v_buf, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, int64_t page_size, double scale) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [B, H, D] with contiguous heads");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(1) / k_buf.size(1) <= kMaxG && q.size(2) % 16 == 0 && q.size(2) <= 256,
              "decode_attention: needs head_dim % 16 == 0, <= 256 and <= 16 q heads per KV head");
  auto table = block_table.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == at::kBFloat16 && k_buf.scalar_type() == at::kBFloat16 &&
      decode_bf16_serves(q.size(1), k_buf.size(1), q.size(2))) {
    decode_attention_bf16(q, k_buf, v_buf, table, lens, out, page_size, scale);
    return out;
  }
  const auto dt = q.scalar_type();
  if ((dt == at::kFloat || dt == at::kBFloat16) && k_buf.scalar_type() == dt &&
      decode_avx2_serves(q.size(1), k_buf.size(1), q.size(2))) {
    decode_attention_avx2(q, k_buf, v_buf, table, lens, out, page_size, scale);
    return out;
  }
  PD_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    decode_attn_impl<scalar_t>(q, k_buf, v_buf, table, lens, out, page_size, scale);
  });
  return out;
}

}  // namespace

// extend_attention.cpp
bool has_extend_attention();
bool extend_attention_amx(int64_t head_dim);
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& kv_pages, const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& q_lens, int64_t page_size, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_and_store", &rope_and_store);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("decode_attention", &decode_attention);
  m.def("small_linear", &small_linear, py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("has_extend_attention", &has_extend_attention);
  m.def("extend_attention_amx", &extend_attention_amx);
  m.def("extend_attention", &extend_attention);
}
