// omnigen primitive: one warp-wide tensor-core product, D[16x8] += A[16x16] * B[16x8] (sm_80+),
// fp32 accumulators, and the packing of fp32 pairs into the 16-bit operand registers.
//
// Fragment layout (lane t, g = t / 4, c = 2 * (t % 4)):
//   A: a0 = (row g, k c..c+1)  a1 = (row g+8, k c..c+1)  a2 = (row g, k c+8..)  a3 = (row g+8, k c+8..)
//   B: b0 = (k c..c+1, col g)  b1 = (k c+8.., col g)
//   D: d0, d1 = (row g, cols c, c+1)  d2, d3 = (row g+8, cols c, c+1)
#pragma once
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace omnigen {

// Element: __nv_bfloat16 or __half. The two differ only in the instruction's operand type and the pack
// conversion, chosen at compile time.
template <typename Element>
struct Mma {
  static_assert(std::is_same_v<Element, __nv_bfloat16> || std::is_same_v<Element, __half>, "bf16 or fp16 operands");

  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
  }
  static __device__ __forceinline__ uint32_t pack(float low, float high) {
    if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
      __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
      return *reinterpret_cast<uint32_t*>(&pair);
    } else {
      __half2 pair = __floats2half2_rn(low, high);
      return *reinterpret_cast<uint32_t*>(&pair);
    }
  }
};

}  // namespace omnigen
