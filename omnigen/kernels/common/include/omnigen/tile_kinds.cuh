// omnigen: the tile kinds of a plan's schedules (omnigen.Plan.kinds: full, causal, partial; empty tiles are never
// scheduled) and the walk over one CTA's schedule in its three code paths, for every kernel family.
#pragma once
#include <type_traits>

namespace omnigen {

enum class TileKind { kFull, kCausal, kPartial };

// Walks a CTA's schedule in its three code paths, in order: visit(kind_tag, position) for the full tiles
// [full_begin, causal_begin), then the causal ones up to partial_begin, then the partial ones up to tiles_end.
// kind_tag is a std::integral_constant<TileKind, ...>, so each loop compiles to its own straight-line body.
template <typename Visit>
__device__ __forceinline__ void for_each_tile(int full_begin, int causal_begin, int partial_begin, int tiles_end, Visit&& visit) {
  int position = full_begin;
  // Full path: no mask work.
  for (; position < causal_begin; ++position) visit(std::integral_constant<TileKind, TileKind::kFull>{}, position);
  // Causal path: one compare per score.
  for (; position < partial_begin; ++position) visit(std::integral_constant<TileKind, TileKind::kCausal>{}, position);
  // Partial path: the generated predicate.
  for (; position < tiles_end; ++position) visit(std::integral_constant<TileKind, TileKind::kPartial>{}, position);
}

}  // namespace omnigen
