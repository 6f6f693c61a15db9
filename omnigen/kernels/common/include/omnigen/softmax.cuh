// omnigen primitive: the arithmetic of the online softmax.
// Four lanes of a quad (t, t^1, t^2, t^3) hold the columns of one accumulator row.
#pragma once

namespace omnigen {

// 2^x with the hardware approximation; ex2(-inf) is +0, which is what keeps masked scores harmless.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float value) {
  value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 1));
  return fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 2));
}

__device__ __forceinline__ float quad_sum(float value) {
  value += __shfl_xor_sync(0xffffffffu, value, 1);
  return value + __shfl_xor_sync(0xffffffffu, value, 2);
}

}  // namespace omnigen
