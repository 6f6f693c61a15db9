// omnigen primitive: a block of threads copies rows of a [rows][kHeadDim] 16-bit tile from global memory
// into a swizzled shared-memory tile (cp.async, 16 bytes per copy), rows past the end becoming zeros; and
// the same rows' token tables (4 bytes per copy).
#pragma once
#include <cstdint>

#include "omnigen/sm80/cp_async.cuh"
#include "omnigen/sm80/smem_tile.cuh"
#include "omnigen/tokens.cuh"

namespace omnigen {

// Copy `kRows` rows (rows >= `rows_left` become zeros) into the swizzled tile at shared address `tile`.
// A thread always copies the same chunk column, kThreads / chunks rows apart; the source pointer
// advances by one step per copy (precomputing every row's offset would hold 64-bit registers).
template <int kRows, int kThreads, int kHeadDim, typename Element>
__device__ __forceinline__ void copy_tile_rows(uint32_t tile, const Element* source, int64_t row_stride, int rows_left) {
  using Tile = SwizzledTile<kHeadDim>;
  constexpr int kChunks = Tile::kChunks;
  static_assert(kThreads % kChunks == 0, "a thread's chunk column is fixed");
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kRows % kRowStep == 0, "every thread copies the same number of chunks");
  const int first_row = threadIdx.x / kChunks, chunk = threadIdx.x % kChunks;
  const Element* from = source + first_row * row_stride + chunk * 8;
  const int64_t step = kRowStep * row_stride;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const int row = first_row + i * kRowStep;
    const bool valid = row < rows_left;
    cp_async_16(tile + 2 * Tile::offset(row, chunk), valid ? from : source, valid);
    from += step;
  }
}

// The token tables of the kRows tokens at positions start, start + 1, ... of one batch element (its tables
// begin at token `slice` of args.token_*), as cp.async copies by a block of kThreads threads: they land with
// the tile rows of the same commit group. Positions at or past seq_len become zeros (their scores are masked
// by position, never by these tables).
template <int kRows, int kThreads, bool kDocuments, typename Args>
__device__ __forceinline__ void copy_tokens(TokenTables<kRows>& tables, const Args& args, int64_t slice, int start,
                                            int seq_len) {
  for (int row = threadIdx.x; row < kRows; row += kThreads) {
    const bool valid = start + row < seq_len;
    const int64_t at = valid ? slice + start + row : 0;
    cp_async_4(&tables.segment[row], args.token_segment + at, valid);
    cp_async_4(&tables.modality[row], args.token_modality + at, valid);
    if constexpr (kDocuments) cp_async_4(&tables.document[row], args.token_doc + at, valid);
  }
}

}  // namespace omnigen
