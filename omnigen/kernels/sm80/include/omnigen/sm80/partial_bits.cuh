// omnigen: partial tiles' masks as bits (omnigen.plan.bits) in the sm80 kernels' mma.sync tiles, and the walks over a
// schedule that send each partial tile down the path that reads them or down the rules' path.
//
// The slots' layout is the one the sm90 kernels read, and it serves the mma.sync fragments unchanged. A slot keeps,
// for each tile row m and quad lane t, the columns c(t, v) = 8 (v / 2) + 2 t + v % 2 as bit v % 32 of word v / 32,
// words stored [word][row][t]. An m16n8 accumulator gives lane t exactly those columns of a row (element [n][c] of a
// thread sits in column 8 n + 2 (lane % 4) + c, value v = 2 n + c): wgmma's accumulator is made of the same m16n8
// pieces. Only which rows a thread holds differs (lane / 4 + 8 h of each 16-row block of its warp, not a warpgroup's
// 64-row slab), and a slot is addressed by row, so a thread loads the word of each row it holds: one 32-bit load per
// row and step, the 32 lanes of a warp reading 8 rows x 4 quad lanes, 128 contiguous bytes. A layout of sm80's own
// would buy nothing here, and would make the plan know the kernel family and hold every mask's bits twice.
//
// The backward schedule's slots are the tile transposed (the kv-tile's keys as rows, its queries as columns): the
// layout of dkdv_kernel's S^T, which reads them as the forward reads its own. The deterministic dQ kernel walks the
// forward schedule but BackwardArgs carries only the backward's slots, so it reads them across (TransposedBits) and
// finds each tile's slot in the backward schedule (transposed_slot).
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "omnigen/tile_kinds.cuh"

namespace omnigen {

// A partial tile whose mask the caller passed as bits: the partial path, reading its slot instead of the rules.
// decltype(tag)::value is still TileKind::kPartial, so code that asks only the kind treats it as partial.
struct PartialFromBits : std::integral_constant<TileKind, TileKind::kPartial> {};

template <typename Tag>
constexpr bool kFromBits = std::is_same_v<std::decay_t<Tag>, PartialFromBits>;

// A slot of kRows rows (the forward schedule's: block_m queries; the backward's: block_n keys) of kColumns columns.
template <int kRows, int kColumns>
struct SlotShape {
  static constexpr int kRowWords = (kColumns + 127) / 128;  // words per row and quad lane (plan.bits.mask_words)
  static constexpr int kWords = kRowWords * kRows * 4;      // words per slot (plan.bits.slot_words)

  // The value of tile column `column` in its quad lane's row, (column % 8) / 2 being that lane: c(t, v) inverted.
  __host__ __device__ static constexpr int value_of(int column) { return 2 * (column / 8) + column % 2; }
  // Offset from the slot's first word of the word holding value v of quad lane t in tile row `row`.
  __host__ __device__ static constexpr int word_offset(int row, int t, int v) { return ((v / 32) * kRows + row) * 4 + t; }
};

// A thread's bits of one slot for one step of an mma.sync tile whose rows are the slot's rows: element [a][n][e] of
// its accumulators is row first_row + 16 a + 8 (e / 2) and column first_column + 8 n + 2 (lane % 4) + e % 2, where
// first_row is the warp's first row plus lane / 4 and first_column (a multiple of kSpan) the step's first column.
template <int kRows, int kColumns, int kBlocks, int kSpan>
struct FragmentBits {
  using Shape = SlotShape<kRows, kColumns>;
  // A step's values of a row lie in one word, or its words start at a word's first bit.
  static_assert(kSpan % 8 == 0 && (128 % kSpan == 0 || kSpan % 128 == 0 || kSpan == kColumns),
                "a step's columns must divide 128, be whole words of them, or be the whole tile");
  static constexpr int kWords = (kSpan + 127) / 128;
  uint32_t word[kBlocks][2][kWords];  // row block a, half h: value 2 n + c of the step is bit 2 n + c (of word / 32)

  // Word v0 / 32 of each row: one load per row (and 128 columns), 128 contiguous bytes per warp.
  __host__ __device__ static constexpr int offset(int a, int h, int w, int first_row, int first_column, int lane) {
    return Shape::word_offset(first_row + 16 * a + 8 * h, lane % 4, first_column / 4 + 32 * w);
  }
  // Where the step's values start in the loaded word (0 when a step is whole words).
  __host__ __device__ static constexpr int shift(int first_column) { return kWords == 1 ? (first_column / 4) % 32 : 0; }

  __device__ __forceinline__ void load(const uint32_t* bits, int slot, int first_row, int first_column, int lane) {
    const uint32_t* slot_words = bits + int64_t(slot) * Shape::kWords;
#pragma unroll
    for (int a = 0; a < kBlocks; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          word[a][h][w] = __ldg(slot_words + offset(a, h, w, first_row, first_column, lane)) >> shift(first_column);
        }
      }
    }
  }

  __host__ __device__ __forceinline__ bool kept(int a, int n, int e) const {
    const int v = 2 * n + e % 2;
    return (word[a][e / 2][v / 32] >> (v % 32)) & 1u;
  }

  // Masked scores become -inf. Bits past the end of the sequence are 0: no tail check on this path.
  template <int N>
  __device__ __forceinline__ void apply(float (&score)[kBlocks][N][4]) const {
    static_assert(N * 8 == kSpan, "the step's n8 blocks");
#pragma unroll
    for (int a = 0; a < kBlocks; ++a) {
#pragma unroll
      for (int n = 0; n < N; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) score[a][n][e] = kept(a, n, e) ? score[a][n][e] : -INFINITY;
      }
    }
  }
};

// The dQ kernel's bits: its tile has rows of queries (one m16 block: first_row and first_row + 8, first_row % 16 < 8)
// and columns of keys, but it reads the backward's transposed slots (kRows = block_n keys as rows, kColumns = block_m
// queries as columns). Key column k of the step is slot row k; query row r is value value_of(r) of quad lane
// (r % 8) / 2 -- for the thread's two rows the same lane (lane / 8) and word, values two apart. So one 32-bit load per
// key column (kSpan / 4 per step) where the forward layout takes two: the price of reading across, paid only by
// the deterministic mode's dQ kernel on partial tiles with bits.
template <int kRows, int kColumns, int kSpan>
struct TransposedBits {
  using Shape = SlotShape<kRows, kColumns>;
  static_assert(kSpan % 8 == 0, "whole n8 blocks of keys");
  uint32_t word[kSpan / 8][2];  // key column first_key + 8 n + 2 (lane % 4) + c: bit 0 row first_row, bit 2 row + 8

  __host__ __device__ static constexpr int offset(int n, int c, int first_row, int first_key, int lane) {
    return Shape::word_offset(first_key + 8 * n + 2 * (lane % 4) + c, (first_row % 8) / 2, Shape::value_of(first_row));
  }
  __host__ __device__ static constexpr int shift(int first_row) { return Shape::value_of(first_row) % 32; }

  __device__ __forceinline__ void load(const uint32_t* bits, int slot, int first_row, int first_key, int lane) {
    const uint32_t* slot_words = bits + int64_t(slot) * Shape::kWords;
#pragma unroll
    for (int n = 0; n < kSpan / 8; ++n) {
#pragma unroll
      for (int c = 0; c < 2; ++c) word[n][c] = __ldg(slot_words + offset(n, c, first_row, first_key, lane)) >> shift(first_row);
    }
  }

  __host__ __device__ __forceinline__ bool kept(int n, int e) const { return (word[n][e % 2] >> (2 * (e / 2))) & 1u; }

  // Masked scores become -inf (a tile of one m16 block: [1][n][e]).
  template <int N>
  __device__ __forceinline__ void apply(float (&score)[1][N][4]) const {
    static_assert(N * 8 == kSpan, "the step's n8 blocks");
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) score[0][n][e] = kept(n, e) ? score[0][n][e] : -INFINITY;
    }
  }
};

// A schedule row's partial entries p (from partial_begin) have slots first_slot + (p - partial_begin), and those below
// partial_slots hold bits: slots run on in schedule order and the capacity cuts them, so the entries with bits are a
// prefix of the row's partial entries, [partial_begin, end). first_slot_of() loads the row's first slot, called only
// when the caller passed bits and the row has partial entries (else first_slot -1 and end partial_begin).
struct BitsPrefix {
  int first_slot, end;
};

template <typename FirstSlot>
__device__ __forceinline__ BitsPrefix bits_prefix(int partial_slots, int partial_begin, int tiles_end, FirstSlot&& first_slot_of) {
  if (partial_slots <= 0 || partial_begin >= tiles_end) return {-1, partial_begin};
  const int first = first_slot_of();
  return {first, partial_begin + max(0, min(partial_slots - first, tiles_end - partial_begin))};
}

// for_each_tile with the partial path split by where a tile's mask comes from: visit(kind_tag, position, slot) for the
// full tiles, the causal ones, the partial ones with bits (PartialFromBits, their slot) and the partial ones without
// (the rules' path, slot -1), each loop its own straight-line body. The row's slot start is read after the causal
// loop, so nothing more is held across the first two. Without kReadsBits (a variant that does not read bits) the
// partial path is the rules' alone, as in for_each_tile.
template <bool kReadsBits, typename FirstSlot, typename Visit>
__device__ __forceinline__ void for_each_path(int full_begin, int causal_begin, int partial_begin, int tiles_end,
                                              int partial_slots, FirstSlot&& first_slot_of, Visit&& visit) {
  int position = full_begin;
  // Full path: no mask work.
  for (; position < causal_begin; ++position) visit(std::integral_constant<TileKind, TileKind::kFull>{}, position, -1);
  // Causal path: one compare per score.
  for (; position < partial_begin; ++position) visit(std::integral_constant<TileKind, TileKind::kCausal>{}, position, -1);
  // Partial path, from the mask's bits: one select per score.
  if constexpr (kReadsBits) {
    const BitsPrefix with_bits = bits_prefix(partial_slots, partial_begin, tiles_end, first_slot_of);
    for (int slot = with_bits.first_slot; position < with_bits.end; ++position, ++slot) visit(PartialFromBits{}, position, slot);
  }
  // Partial path, the rules' predicate.
  for (; position < tiles_end; ++position) visit(std::integral_constant<TileKind, TileKind::kPartial>{}, position, -1);
}

// The slot, in the backward schedule's bits, of the tile at row q_tile of kv-tile column `column` (batch element's
// column index b * num_kv_tiles + j), for a kernel that walks the forward schedule: the rank of q_tile among the
// column's partial entries of bwd_q, which the warp looks for 32 entries at a time (any order); -1 when the tile has
// no bits. Every lane of the warp calls it and gets the same answer.
__device__ __forceinline__ int transposed_slot(const int32_t* bwd_ptr, const int32_t* bwd_q, const int32_t* partial_slot,
                                               int partial_slots, int64_t column, int q_tile, int lane) {
  if (partial_slots <= 0) return -1;
  const int begin = __ldg(bwd_ptr + 3 * column + 2), end = __ldg(bwd_ptr + 3 * column + 3);
  for (int first = begin; first < end; first += 32) {
    const int entry = first + lane;
    const unsigned found = __ballot_sync(0xffffffffu, entry < end && __ldg(bwd_q + entry) == q_tile);
    if (found != 0u) {
      const int slot = __ldg(partial_slot + column) + (first - begin) + __ffs(found) - 1;
      return slot < partial_slots ? slot : -1;
    }
  }
  return -1;  // not among the column's partial entries (a plan whose schedules disagree): the rules' path
}

// The dQ kernel's walk over the forward schedule: as for_each_path, but a partial tile's slot comes from the backward
// schedule (slot_of(position), transposed_slot), whose bits need not be a prefix of this row's partial entries, so
// each partial tile picks its path as it comes (kReadsBits: as for_each_path).
template <bool kReadsBits, typename SlotOf, typename Visit>
__device__ __forceinline__ void for_each_path_across(int full_begin, int causal_begin, int partial_begin, int tiles_end,
                                                     SlotOf&& slot_of, Visit&& visit) {
  int position = full_begin;
  for (; position < causal_begin; ++position) visit(std::integral_constant<TileKind, TileKind::kFull>{}, position, -1);
  for (; position < partial_begin; ++position) visit(std::integral_constant<TileKind, TileKind::kCausal>{}, position, -1);
  for (; position < tiles_end; ++position) {
    if constexpr (kReadsBits) {
      const int slot = slot_of(position);
      if (slot >= 0) {
        visit(PartialFromBits{}, position, slot);
        continue;
      }
    }
    visit(std::integral_constant<TileKind, TileKind::kPartial>{}, position, -1);
  }
}

}  // namespace omnigen
