// omnigen: a thread's view of a tensor-core accumulator fragment, and sets of its columns as bits.
// Thread `lane` of a warp holds, for every 8-column block j of the warp's 16 rows, the columns
// 8j + 2 (lane % 4) + {0, 1} of rows lane / 4 (registers 4j, 4j+1) and lane / 4 + 8 (registers 4j+2, 4j+3): the
// layout of mma.sync m16n8 and of each warp's rows of a wgmma accumulator. Register i's row half is i / 2 % 2.
#pragma once
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace omnigen {

__device__ __forceinline__ int column_of(int i, int lane) { return 8 * (i / 4) + 2 * (lane % 4) + (i % 2); }
__device__ __forceinline__ int half_of(int i) { return (i / 2) % 2; }

// Two floats as a packed pair of the element type (low, high).
template <typename Element>
__device__ __forceinline__ uint32_t pack(float low, float high) {
  if constexpr (std::is_same_v<Element, __half>) {
    __half2 pair = __floats2half2_rn(low, high);
    return *reinterpret_cast<uint32_t*>(&pair);
  } else {
    __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<uint32_t*>(&pair);
  }
}

// Four floats as e4m3 bytes, `a` the lowest (saturated to +-448, NaN kept): one conversion instruction per pair.
__device__ __forceinline__ uint32_t pack_fp8x4(float a, float b, float c, float d) {
  const uint32_t low = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t high = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return low | (high << 16);
}

// A thread's columns of one row as bits: column 8 (j / 2) + 2 (lane % 4) + j % 2 is bit j % 32 of word j / 32.
// How many of them lie below tile column x (any int: clamps to 0 and kWidth / 4), in a tile kWidth columns wide.
template <int kWidth>
__device__ __forceinline__ int columns_below(int x, int lane) {
  const int y = min(x, kWidth) - 2 * (lane % 4);
  return y <= 0 ? 0 : 2 * (y >> 3) + min(y & 7, 2);
}

// Word w of a multi-word mask of the `count` lowest bits (the thread's first `count` columns).
__device__ __forceinline__ uint32_t low_bits(int count, int w) {
  const int n = count - 32 * w;
  return n >= 32 ? 0xffffffffu : n <= 0 ? 0u : (1u << n) - 1u;
}

}  // namespace omnigen
