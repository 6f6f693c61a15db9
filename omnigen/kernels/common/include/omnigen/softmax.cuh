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

// v[0] becomes `combine` of v[0..kCount) (fmaxf: the max; a sum), taken in pairs: log2(kCount) dependent steps, not
// kCount.
template <int kCount, typename Combine>
__device__ __forceinline__ float tree_reduce(float (&v)[kCount], Combine combine) {
#pragma unroll
  for (int width = kCount / 2; width > 0; width /= 2) {
#pragma unroll
    for (int c = 0; c < width; ++c) v[c] = combine(v[c], v[c + width]);
  }
  return v[0];
}

// Online softmax state of a thread's two rows (register i of kScores is row half_of(i)): running max (log2 units,
// scaled), partial row sums. Each row's max and sum of a step run in kChains independent chains (register i in
// chain (i / 4) % kChains), combined in pairs at the end: one chain is kScores / 2 dependent FMNMX (and FADD),
// whose latency a warp with few neighbours to switch to waits out. (kChains = 1: a single chain each.)
template <int kScores, int kChains = 1>
struct RowPairSoftmax {
  static_assert(kChains >= 1 && (kChains & (kChains - 1)) == 0, "chains: a power of two");
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.f, 0.f};

  // Turns scores into probabilities in place and returns the factor each row's output must be scaled by.
  __device__ __forceinline__ void step(float (&s)[kScores], float scale_log2, float (&rescale)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float chain_max[kChains];
#pragma unroll
      for (int c = 0; c < kChains; ++c) chain_max[c] = -INFINITY;
#pragma unroll
      for (int i = 0; i < kScores; ++i) {
        if (half_of(i) == h) chain_max[(i / 4) % kChains] = fmaxf(chain_max[(i / 4) % kChains], s[i]);
      }
      const float tile_max =
          quad_max(tree_reduce(chain_max, [](float a, float b) { return fmaxf(a, b); })) * scale_log2;
      const float new_max = fmaxf(max[h], tile_max);
      // A row with no allowed key so far keeps max -inf: offset 0 makes every exp2 exactly 0.
      const float offset = new_max == -INFINITY ? 0.f : new_max;
      rescale[h] = exp2_fast(max[h] - offset);
      max[h] = new_max;
      float chain_sum[kChains];
#pragma unroll
      for (int c = 0; c < kChains; ++c) chain_sum[c] = 0.f;
#pragma unroll
      for (int i = 0; i < kScores; ++i) {
        if (half_of(i) == h) {
          s[i] = exp2_fast(s[i] * scale_log2 - offset);
          chain_sum[(i / 4) % kChains] += s[i];
        }
      }
      sum[h] = sum[h] * rescale[h] + tree_reduce(chain_sum, [](float a, float b) { return a + b; });
    }
  }
};

}  // namespace omnigen
