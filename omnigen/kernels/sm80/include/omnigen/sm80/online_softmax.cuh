// omnigen: one step of the online softmax (FlashAttention-2) on a warp tile of mma.sync accumulators: a
// thread's scores[m][n][e] are rows 16 m + 8 (e / 2) (+ lane / 4) of the warp, and the four lanes of a quad
// hold the columns of one row (see warp_tile.cuh).
#pragma once

#include "omnigen/softmax.cuh"

namespace omnigen {

// Scores (unscaled) -> probabilities in place, against each row's reference max; row_sum gets this thread's
// partial sums (quad-reduced at the end) and `out` is rescaled where a row's max moved.
//
// The reference max lags: a row's exponentials use row_max, which moves only when a score exceeds it by
// more than kMaxLag (in log2 units after scaling); only then is what was accumulated rescaled. In between,
// P <= 2^kMaxLag: exact in fp32 sums and harmless in bf16/fp16 P, and most steps skip the rescale
// (2 x head_dim / 8 x 2 multiplies per row pair).
constexpr float kMaxLag = 8.0f;  // how far (log2 units) a row's reference max may trail its true max

template <int M, int N, int D>
__device__ __forceinline__ void online_softmax_step(float (&score)[M][N][4], float (&row_max)[M][2], float (&row_sum)[M][2],
                                                    float (&out)[M][D][4], float scale_log2) {
  float step_max[M][2];
  bool any_move = false;
#pragma unroll
  for (int a = 0; a < M; ++a) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < N; ++n) tile_max = fmaxf(tile_max, fmaxf(score[a][n][2 * h], score[a][n][2 * h + 1]));
      step_max[a][h] = quad_max(tile_max);
      // -inf (no allowed key yet) compares below any finite score, and an all-masked step moves nothing.
      any_move |= step_max[a][h] * scale_log2 > row_max[a][h] * scale_log2 + kMaxLag;
    }
  }
  // One vote per step (warp-uniform: the multiplies run for every lane or none; rows that do not move
  // multiply by 1 in the rare steps where some row does). A vote per row half cost 4-7% of the whole
  // forward: four dependent vote-and-branch chains between the two mma phases of every step.
  if (__any_sync(0xffffffffu, any_move)) {
#pragma unroll
    for (int a = 0; a < M; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float old_scaled = row_max[a][h] * scale_log2;
        const bool move = step_max[a][h] * scale_log2 > old_scaled + kMaxLag;
        const float rescale = move ? exp2_fast(old_scaled - step_max[a][h] * scale_log2) : 1.f;
        if (move) row_max[a][h] = step_max[a][h];
        row_sum[a][h] *= rescale;
#pragma unroll
        for (int d = 0; d < D; ++d) {
          out[a][d][2 * h] *= rescale;
          out[a][d][2 * h + 1] *= rescale;
        }
      }
    }
  }
#pragma unroll
  for (int a = 0; a < M; ++a) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // A row with no allowed key so far keeps max = -inf; subtracting 0 instead keeps every
      // exp2 argument at -inf (-> 0) rather than -inf - -inf (NaN).
      const float max_scaled = row_max[a][h] == -INFINITY ? 0.f : row_max[a][h] * scale_log2;
      float tile_sum = 0.f;
#pragma unroll
      for (int n = 0; n < N; ++n) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float p = exp2_fast(fmaf(score[a][n][2 * h + c], scale_log2, -max_scaled));
          score[a][n][2 * h + c] = p;
          tile_sum += p;
        }
      }
      row_sum[a][h] += tile_sum;  // per-thread partial sums; quad-reduced at the end
    }
  }
}

}  // namespace omnigen
