// omnigen: where a tile's runs of one segment start, and a walk over them, a warp at a time: the partial-tile mask
// built run by run (a row's allowed keys within one segment are one interval: sees_other_segment in mask_rules.cuh).
#pragma once
#include <cstdint>

namespace omnigen {

// Where a tile's runs of one segment start, among its first `valid` of kColumns columns (keys in the forward, a
// step's queries in the backward): a ballot per 32 columns marks each column whose segment differs from the one
// before (and column 0). Lane w keeps word w, so that no array is indexed at run time (it would live in local
// memory).
template <int kColumns>
struct RunStarts {
  static constexpr int kWords = (kColumns + 31) / 32;
  uint32_t lane_word = 0u;  // lane w: word w (bit c % 32: column 32 w + c starts a run)
  int count = 0;            // how many runs
  __device__ __forceinline__ RunStarts(const int32_t* segments, int valid, int lane) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      const int column = 32 * w + lane;
      const int at = min(column, valid - 1), before = max(min(column, valid) - 1, 0);
      const bool start = (column < valid) & ((column == 0) | (segments[at] != segments[before]));  // no branch
      const uint32_t word = __ballot_sync(0xffffffffu, start);
      lane_word = lane == w ? word : lane_word;
      count += __popc(word);
    }
  }
};

// Walks a tile's runs in order from column 0: next() gives each next run's first column, `valid` after the last.
// `word` is the starts' word in hand (uniform across the warp), fetched from lane w by a shuffle.
template <int kColumns>
struct RunWalk {
  uint32_t lane_word, word;
  int w = 0;
  __device__ __forceinline__ explicit RunWalk(const RunStarts<kColumns>& starts)
      : lane_word(starts.lane_word), word(__shfl_sync(0xffffffffu, starts.lane_word, 0) & ~1u) {}  // 0: the first
  __device__ __forceinline__ int next(int valid) {
    while (word == 0u && w + 1 < RunStarts<kColumns>::kWords) word = __shfl_sync(0xffffffffu, lane_word, ++w);
    const int column = word != 0u ? 32 * w + __ffs(word) - 1 : valid;
    word &= word - 1u;
    return column;
  }
};

}  // namespace omnigen
