// omnigen primitive: the arithmetic of the online softmax, and its state for a thread's two rows of an accumulator
// fragment (omnigen/fragment.cuh). Four lanes of a quad (t, t^1, t^2, t^3) hold the columns of one accumulator row.
#pragma once
#include <cmath>

#include "omnigen/fragment.cuh"

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

// Online softmax state of a thread's two rows (register i of kScores is row half_of(i)): running max (log2 units,
// scaled), partial row sums.
template <int kScores>
struct RowPairSoftmax {
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.f, 0.f};

  // Turns scores into probabilities in place and returns the factor each row's output must be scaled by.
  __device__ __forceinline__ void step(float (&s)[kScores], float scale_log2, float (&rescale)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int i = 0; i < kScores; ++i) {
        if (half_of(i) == h) tile_max = fmaxf(tile_max, s[i]);
      }
      tile_max = quad_max(tile_max) * scale_log2;
      const float new_max = fmaxf(max[h], tile_max);
      // A row with no allowed key so far keeps max -inf: offset 0 makes every exp2 exactly 0.
      const float offset = new_max == -INFINITY ? 0.f : new_max;
      rescale[h] = exp2_fast(max[h] - offset);
      max[h] = new_max;
      float row_sum = 0.f;
#pragma unroll
      for (int i = 0; i < kScores; ++i) {
        if (half_of(i) == h) {
          s[i] = exp2_fast(s[i] * scale_log2 - offset);
          row_sum += s[i];
        }
      }
      sum[h] = sum[h] * rescale[h] + row_sum;
    }
  }
};

}  // namespace omnigen
