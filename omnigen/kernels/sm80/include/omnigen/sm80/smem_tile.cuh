// omnigen primitive: where element (row, 16-byte chunk) of a [rows][kHeadDim] 16-bit tile lives in
// shared memory. Chunks are XOR-swizzled by row % 8, so the 8 rows an ldmatrix reads (or a warp
// writes) at one chunk index fall into 8 different bank groups: no bank conflicts and no padding.
#pragma once
#include <cstdint>

namespace omnigen {

template <int kHeadDim>
struct SwizzledTile {
  static_assert(kHeadDim % 64 == 0, "a row must hold a multiple of 8 chunks of 16 bytes");
  static constexpr int kChunks = kHeadDim / 8;      // 16-byte chunks per row
  static constexpr int kRowBytes = kHeadDim * 2;

  // Offset in elements of the first element of chunk `chunk` in row `row`.
  static __device__ __forceinline__ int offset(int row, int chunk) {
    return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
  }

  // ldmatrix over 16-column steps: at step kk a lane reads chunk 2 * kk + low_bit of a row with
  // row % 8 == lane % 8. The swizzle touches only the low three chunk bits, so the chunk's byte
  // offset is 128 * (kk / 4) (compile-time) plus one of four per-lane patterns (kk % 4):
  static __device__ __forceinline__ uint32_t lane_pattern_bytes(int pattern, int low_bit, int lane) {
    return uint32_t(((2 * pattern + low_bit) ^ (lane & 7)) << 4);
  }
  static __host__ __device__ constexpr uint32_t step_bytes(int kk) { return uint32_t(kk / 4) * 128u; }

  // The pattern above gives an x4 ldmatrix the order an mma A operand wants (rows 0-7 low half, rows
  // 8-15 low, rows 0-7 high, rows 8-15 high). A B operand (the n8 blocks' rows, e.g. keys in Q K^T)
  // wants rows 0-7 low, rows 0-7 high, rows 8-15 low, rows 8-15 high, so that each n8 block's two
  // registers come out adjacent; otherwise every fragment costs register moves before its mma.
  // Lane l then reads row (l / 16) * 8 + l % 8 at low bit (l / 8) % 2. The row keeps its swizzle phase
  // (l % 8) and the swizzle flips only the chunk's low bit with it, so the B address is the A address
  // plus this per-lane constant, the same for every step kk.
  static __device__ __forceinline__ int32_t b_operand_offset_bytes(int lane) {
    const int row_a = lane % 16, low_a = lane / 16;
    const int row_b = (lane / 16) * 8 + lane % 8, low_b = (lane / 8) % 2;
    return (row_b - row_a) * kRowBytes + (((low_b ^ (lane & 1)) - (low_a ^ (lane & 1))) << 4);
  }
};

}  // namespace omnigen
