// Vector helpers shared by the CPU kernels (cpu_ops.cpp, extend_attention.cpp): 16-float
// vectors in GCC's vector extension (lowered to AVX-512 or AVX2 pairs by -march=native),
// bf16 <-> float conversion, a vectorised exp, and rounding to the storage dtype.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

template <typename T>
inline float f(T v) { return static_cast<float>(v); }

template <typename T>
inline T r(float v) { return static_cast<T>(v); }  // round to the storage dtype

// 16 floats: GCC lowers it to whatever vector width -march=native offers (AVX-512 here).
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v16 load16(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
template <typename T>
inline v16 load16(const T* p) {  // half, double: element by element
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16 __attribute__((vector_size(64)));

inline float hsum(v16 v) {  // tree reduction: 4 adds instead of 15
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp of 16 floats (Cephes' expf: range reduction by ln 2, degree-6 polynomial, scale by
// 2^n through the exponent bits); within ~2 ulp of libm, inputs clamped to +-88.37.
inline v16 vexp(v16 x) {
  const v16 hi = v16{} + 88.3762626647949f;
  x = x < hi ? x : hi;
  x = x > -hi ? x : -hi;
  v16 fx = x * 1.44269504088896341f + 0.5f;
  i16 n = __builtin_convertvector(fx, i16);
  v16 nf = __builtin_convertvector(n, v16);
  i16 over = nf > fx;  // truncation rounded a negative value up: floor is one less
  n += over;
  nf = __builtin_convertvector(n, v16);
  x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16 z = x * x;
  v16 y = ((((1.9875691500E-4f * x + 1.3981999507E-3f) * x + 8.3334519073E-3f) * x +
            4.1665795894E-2f) * x + 1.6666665459E-1f) * x + 5.0000001201E-1f;
  y = y * z + x + 1.f;
  i16 bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// softmax numerator in place over s[0, n): exp(s - max); returns 1 / sum (0 when empty).
inline float exp_normaliser(float* s, int64_t n) {
  float m = -INFINITY;
  for (int64_t t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
  v16 acc{};
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    v16 e = vexp(load16(s + t) - m);
    std::memcpy(s + t, &e, sizeof(e));
    acc += e;
  }
  float sum = hsum(acc);
  for (; t < n; ++t) sum += (s[t] = std::exp(s[t] - m));
  return sum > 0.f ? 1.f / sum : 0.f;
}

// Round 16 floats to T's precision and back (bf16: round to nearest even on the top half),
// and store them as T.
inline v16 round_as(v16 v, const float*) { return v; }
inline v16 round_as(v16 v, const c10::BFloat16*) {
  u32x16 b;
  std::memcpy(&b, &v, sizeof(b));
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}
template <typename T>
inline v16 round_as(v16 v, const T*) {
  for (int i = 0; i < 16; ++i) v[i] = f(r<T>(v[i]));
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline void store16(c10::BFloat16* p, v16 v) {  // top halves of the rounded floats
  v = round_as(v, static_cast<const c10::BFloat16*>(p));
  u32x16 b;
  std::memcpy(&b, &v, sizeof(b));
  u16x16 h = __builtin_convertvector(b >> 16, u16x16);
  std::memcpy(p, &h, sizeof(h));
}
template <typename T>
inline void store16(T* p, v16 v) {
  v = round_as(v, p);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<T>(v[i]);  // exact: already rounded
}

// Calls fn(t, row) for each position t < len of a request whose pages are `pages`, `row`
// pointing `off` elements into token t's slot of a pool buffer whose slots are `tok` apart;
// page by page, so there is no division per token.
template <typename T, typename Fn>
inline void for_each_slot(const T* buf, const int64_t* pages, int64_t len, int64_t ps,
                          int64_t tok, int64_t off, Fn&& fn) {
  for (int64_t t0 = 0; t0 < len; t0 += ps) {
    const T* page = buf + pages[t0 / ps] * ps * tok + off;
    const int64_t n = std::min(ps, len - t0);
    for (int64_t i = 0; i < n; ++i) fn(t0 + i, page + i * tok);
  }
}

}  // namespace
