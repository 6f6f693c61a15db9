// omnigen: tile-level steps of one warp on mma.sync m16n8k16 accumulators (sm_80+).
//
// A warp tile is float acc[M][N][4]: M blocks of 16 rows x N blocks of 8 columns. Lane t holds, of block
// (m, n), element e at row 16 m + t / 4 + 8 (e / 2), column 8 n + 2 (t % 4) + e % 2 (see mma.cuh). The
// helpers below take the thread's own offsets (row t / 4, column 2 (t % 4), plus where the warp tile sits)
// from the caller, so they only add the compile-time part, and everything unrolls into straight-line code.
#pragma once
#include <cstdint>

#include "omnigen/sm80/ldmatrix.cuh"
#include "omnigen/sm80/mma.cuh"

namespace omnigen {

// Every element of an accumulator array (any shape) to `value`.
template <int N>
__device__ __forceinline__ void fill(float (&acc)[N], float value) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = value;
}
template <typename Array, int N>
__device__ __forceinline__ void fill(Array (&acc)[N], float value) {
#pragma unroll
  for (int i = 0; i < N; ++i) fill(acc[i], value);
}
template <typename Array>
__device__ __forceinline__ void zero(Array& acc) {
  fill(acc, 0.f);
}

// The four per-lane ldmatrix addresses of the swizzled [rows][head_dim] tiles (Tile) of the shared memory at
// byte `base`: lane l addresses row l % 16 of a 16-row block at chunk 2 kk + l / 16 of a 16-column step kk, and
// lane_address[kk % 4] is that address for every kk (SwizzledTile::lane_pattern_bytes); the rest (the tile,
// its rows, 128 (kk / 4)) is a compile-time or per-tile offset. One set serves every tile of a kernel.
template <typename Tile>
__device__ __forceinline__ void lane_addresses(uint32_t (&lane_address)[4], uint32_t base, int lane) {
#pragma unroll
  for (int pattern = 0; pattern < 4; ++pattern) {
    lane_address[pattern] = base + (lane % 16) * Tile::kRowBytes + Tile::lane_pattern_bytes(pattern, lane / 16, lane);
  }
}

// acc[m][n] += A[m] B[n]^T over kSteps 16-column steps, both operands [rows][16 kSteps] swizzled tiles in
// shared memory read with ldmatrix: A's 16-row blocks from byte a_bytes on; B's 16-row blocks from row b_row
// of the tile at b_bytes + kTileOffset, read in B order (b_order: SwizzledTile::b_operand_offset_bytes). lane_address[kk % 4]
// is the per-lane part of step kk (SwizzledTile::lane_pattern_bytes). This is S = Q K^T (rows queries),
// S^T = K Q^T and dP = dO V^T on a warp tile. (The tile and the row stay separate terms of the address, as
// in the loops this replaced: summed by the caller, ptxas scheduled the forward differently and spilled.)
template <typename Tile, int kSteps, typename Element, uint32_t kTileOffset = 0, int M, int N>
__device__ __forceinline__ void mma_abt(float (&acc)[M][N][4], const uint32_t (&lane_address)[4], uint32_t a_bytes,
                                        int32_t b_order, uint32_t b_bytes, int b_row) {
  static_assert(N % 2 == 0, "B fragments come in pairs of n8 blocks");
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    uint32_t a[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      ldmatrix_x4(a[m], lane_address[kk % 4] + a_bytes + m * 16 * Tile::kRowBytes + Tile::step_bytes(kk));
    }
#pragma unroll
    for (int nb = 0; nb < N / 2; ++nb) {
      // [0], [1]: B rows nb*16 .. +7 (the B fragment of block 2nb); [2], [3]: rows nb*16+8 .. +15
      uint32_t b[4];
      ldmatrix_x4(b, lane_address[kk % 4] + b_order + b_bytes + kTileOffset + (b_row + nb * 16) * Tile::kRowBytes + Tile::step_bytes(kk));
#pragma unroll
      for (int m = 0; m < M; ++m) {
        Mma<Element>::run(acc[m][2 * nb], a[m], b[0], b[1]);
        Mma<Element>::run(acc[m][2 * nb + 1], a[m], b[2], b[3]);
      }
    }
  }
}

// acc[m][d] += P[m] B over the K columns of P (kK / 16 steps): P is a warp tile of fp32 accumulators,
// packed here into 16-bit A fragments (straight from registers, no shared memory); B is a [kK rows][head dim]
// swizzled tile at b_bytes + kTileOffset read with transposed ldmatrix (row-major rows are the column-major B
// operand), from row b_row on. This is O += P V and dQ += dS K.
template <typename Tile, typename Element, uint32_t kTileOffset = 0, int M, int K, int D>
__device__ __forceinline__ void mma_ab_from_registers(float (&acc)[M][D][4], const float (&p)[M][K][4],
                                                      const uint32_t (&lane_address)[4], uint32_t b_bytes, int b_row) {
  static_assert(K % 2 == 0 && D % 2 == 0, "whole 16-column steps");
#pragma unroll
  for (int ks = 0; ks < K / 2; ++ks) {
    uint32_t p_frag[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      p_frag[m][0] = Mma<Element>::pack(p[m][2 * ks][0], p[m][2 * ks][1]);
      p_frag[m][1] = Mma<Element>::pack(p[m][2 * ks][2], p[m][2 * ks][3]);
      p_frag[m][2] = Mma<Element>::pack(p[m][2 * ks + 1][0], p[m][2 * ks + 1][1]);
      p_frag[m][3] = Mma<Element>::pack(p[m][2 * ks + 1][2], p[m][2 * ks + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < D / 2; ++dp) {
      uint32_t b[4];  // [0], [1]: columns dp*16 .. +7; [2], [3]: dp*16+8 .. +15
      ldmatrix_x4_trans(b, lane_address[dp % 4] + b_bytes + kTileOffset + (b_row + ks * 16) * Tile::kRowBytes + Tile::step_bytes(dp));
#pragma unroll
      for (int m = 0; m < M; ++m) {
        Mma<Element>::run(acc[m][2 * dp], p_frag[m], b[0], b[1]);
        Mma<Element>::run(acc[m][2 * dp + 1], p_frag[m], b[2], b[3]);
      }
    }
  }
}

}  // namespace omnigen
