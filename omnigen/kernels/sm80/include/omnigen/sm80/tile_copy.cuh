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

// The same into the tile at `tile`, a pointer to shared memory.
template <int kRows, int kThreads, int kHeadDim, typename Element>
__device__ __forceinline__ void copy_tile_rows(Element* tile, const Element* source, int64_t row_stride, int rows_left) {
  copy_tile_rows<kRows, kThreads, kHeadDim>(shared_address(tile), source, row_stride, rows_left);
}

// Rows kv_start .. kv_start + kRows - 1 of K and V (kv head kv_head of batch element `batch`; rows at or past
// seq_len become zeros) into the swizzled shared-memory tiles tiles.k and tiles.v. The K/V pointers are computed
// here, per tile, from the parameters: held across a kernel's loop they would cost registers. kAddressLast:
// each tile's shared address is taken after its source row pointer (the forward's order) rather than before
// (the backward's); the same work, but ptxas assigns registers differently, so each kernel keeps its own.
template <int kRows, int kThreads, int kHeadDim, typename Element, bool kAddressLast, typename Tiles, typename Args>
__device__ __forceinline__ void copy_kv_rows(Tiles& tiles, const Args& args, int batch, int kv_head, int kv_start, int seq_len) {
  const Element* k = static_cast<const Element*>(args.k) + batch * args.k_stride_b + kv_head * args.k_stride_h;
  const Element* v = static_cast<const Element*>(args.v) + batch * args.v_stride_b + kv_head * args.v_stride_h;
  if constexpr (kAddressLast) {
    copy_tile_rows<kRows, kThreads, kHeadDim>(tiles.k, k + kv_start * args.k_stride_s, args.k_stride_s, seq_len - kv_start);
    copy_tile_rows<kRows, kThreads, kHeadDim>(tiles.v, v + kv_start * args.v_stride_s, args.v_stride_s, seq_len - kv_start);
  } else {
    copy_tile_rows<kRows, kThreads, kHeadDim>(shared_address(tiles.k), k + kv_start * args.k_stride_s, args.k_stride_s,
                                              seq_len - kv_start);
    copy_tile_rows<kRows, kThreads, kHeadDim>(shared_address(tiles.v), v + kv_start * args.v_stride_s, args.v_stride_s,
                                              seq_len - kv_start);
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
