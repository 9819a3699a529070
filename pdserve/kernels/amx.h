// AMX tile products for the prompt attention kernel (extend_attention.cpp) on CPUs with AMX
// (Sapphire Rapids and later Xeons). One TDPBF16PS multiplies a 16 x 32 bf16 tile by a
// 32 x 16 one (VNNI: pairs of rows interleaved) into 16 x 16 floats: 16 K FLOP per
// instruction, ~8x what AVX512-BF16's VDPBF16PS does in the same cycles. Every tile here is
// 16 rows x 64 bytes, so one configuration serves all eight tile registers.
//
// Tile registers: 0-3 accumulators (16 x 16 floats each), 4 the A operand, 5-7 B operands.
// Each output element depends only on its own row of A and column of B, with a fixed
// accumulation order, so a query row's bits do not depend on which rows share its tile.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

// Linux grants AMX's 8 KiB of tile state per process on request (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once; a kernel
// that refuses (old kernel, VM without AMX state) leaves the AVX512-BF16 path in use.
inline bool ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Per thread (tile configuration is thread state): all eight tiles 16 rows x 64 bytes.
inline void configure() {
  Config c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

inline void release() { _tile_release(); }

// s[16][64] (row stride s_stride floats) = q[16][D] . K block^T, unscaled. q: bf16 rows of
// stride D; k: one block of 64 keys as [4 vectors of 16 keys][D / 2 dim pairs][16][2]
// (D % 32 == 0). Accumulates over the head dims in 32-dim steps, always from dim 0.
inline void scores16(const uint16_t* q, int64_t D, const uint16_t* k, float* s,
                     int64_t s_stride) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t vec = (D / 2) * 32;  // elements per 16-key vector of the block
  for (int64_t dc = 0; dc < D / 32; ++dc) {
    _tile_loadd(4, q + dc * 32, D * 2);
    const uint16_t* kd = k + dc * 16 * 32;  // dim pairs 16 dc .. 16 dc + 15
    _tile_loadd(5, kd, 64);
    _tile_loadd(6, kd + vec, 64);
    _tile_loadd(7, kd + 2 * vec, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, kd + 3 * vec, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  const int64_t st = s_stride * 4;
  _tile_stored(0, s, st);
  _tile_stored(1, s + 16, st);
  _tile_stored(2, s + 32, st);
  _tile_stored(3, s + 48, st);
}

// o[16][64 dims from c0 * 16] (row stride D floats) += p[16][32 h .. 32 h + 31] . V for the
// key halves h < halves (1 or 2) of a 64-key block. p: bf16, row stride p_stride; v: the
// block as [32 key pairs][D][2]. Four 16-dim columns at a time (D % 32 == 0: two or four).
inline void accumulate16(const uint16_t* p, int64_t p_stride, const uint16_t* v, int64_t D,
                         int64_t halves, float* o) {
  const int64_t ost = D * 4, vst = D * 4;
  for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {
    const bool four = D / 16 - c0 >= 4;
    float* oc = o + c0 * 16;
    _tile_loadd(0, oc, ost);
    _tile_loadd(1, oc + 16, ost);
    if (four) {
      _tile_loadd(2, oc + 32, ost);
      _tile_loadd(3, oc + 48, ost);
    }
    for (int64_t h = 0; h < halves; ++h) {
      _tile_loadd(4, p + h * 32, p_stride * 2);
      const uint16_t* vh = v + (h * 16 * D + c0 * 16) * 2;  // key pairs 16 h .., dims 16 c0 ..
      _tile_loadd(5, vh, vst);
      _tile_loadd(6, vh + 32, vst);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      if (four) {
        _tile_loadd(7, vh + 64, vst);
        _tile_loadd(5, vh + 96, vst);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, oc, ost);
    _tile_stored(1, oc + 16, ost);
    if (four) {
      _tile_stored(2, oc + 32, ost);
      _tile_stored(3, oc + 48, ost);
    }
  }
}

}  // namespace amx
#endif
