// omnigen: the rule-independent half of a rules file's mask header (<rules>_mask.cuh). That header holds
// what the rules decide -- modality ids, the self / window / see tables, whether documents are isolated --
// and this one how a kernel evaluates them: a RowRule per query row, and the predicate (docs/semantics.md)
// for one (query, key) pair of a partial tile.
#pragma once
#include <cstdint>

namespace omnigen {

enum class SelfPolicy : int { kCausal, kFull };  // a query in its own segment: k <= q, or every key
enum class See : int { kNone, kEarlier, kAll };   // other segments of the document: none, before it, all

// What the query rows of one modality may see, folded from the rules' tables at compile time.
struct RowRule {
  uint32_t sees_earlier;  // bit k: keys of modality k in earlier segments are allowed
  uint32_t sees_later;    // bit k: keys of modality k in later segments are allowed
  int self_reach;         // own segment: key allowed iff k - q <= self_reach (0 causal, huge full, -huge pad)
  int window;             // key allowed only if q - k < window (huge when the modality has no window)
};

constexpr int kUnlimited = 1 << 30;

// The RowRule of a query modality. `Tables` is the mask header's MaskTables: kNumModalities, kSelf, kWindow,
// kSee, kIsolatedDocuments, kHasWindows. Ids past the last modality (pad) see nothing. Evaluated at compile time
// only: the mask header's row_rule selects between its results per modality (a chain of selects written out
// there; a fold expression over the ids here compiled to other code and cost spills).
template <typename Tables>
__host__ __device__ constexpr RowRule derive_row_rule(int query_modality) {
  RowRule rule{0u, 0u, -kUnlimited, kUnlimited};  // pad: nothing
  if (query_modality >= Tables::kNumModalities) return rule;
  for (int key = 0; key < Tables::kNumModalities; ++key) {
    const See see = Tables::kSee[query_modality][key];
    if (see == See::kEarlier || see == See::kAll) rule.sees_earlier |= 1u << key;
    if (see == See::kAll) rule.sees_later |= 1u << key;
  }
  rule.self_reach = Tables::kSelf[query_modality] == SelfPolicy::kCausal ? 0 : kUnlimited;
  rule.window = Tables::kWindow[query_modality] > 0 ? Tables::kWindow[query_modality] : kUnlimited;
  return rule;
}

// The mask (docs/semantics.md) for one (query, key) pair of a partial tile, under the rules of `Tables` (also
// kIsolatedDocuments and kHasWindows). Positions count from the start of the sequence; segment ids grow
// along it, so `key_segment < query_segment` means "an earlier segment".
template <typename Tables>
__device__ __forceinline__ bool allowed(const RowRule& rule, int query_position, int query_segment, int query_document,
                                        int key_position, int key_segment, int key_modality, int key_document) {
  // Branch-free on purpose: every term is computed and selected, so the partial path compiles to
  // straight-line selects (if/else chains here became per-pair branches and reconvergence points).
  const bool own_ok = key_position - query_position <= rule.self_reach;      // own segment: the self policy
  const uint32_t other_bits = key_segment < query_segment ? rule.sees_earlier  // earlier: see earlier | all
                                                          : rule.sees_later;   // later: see all
  const bool other_ok = (other_bits & (1u << key_modality)) != 0u;
  bool ok = key_segment == query_segment ? own_ok : other_ok;
  if constexpr (Tables::kIsolatedDocuments) ok &= key_document == query_document;  // documents: isolated
  if constexpr (Tables::kHasWindows) ok &= query_position - key_position < rule.window;  // the query's window
  return ok;
}

// The mask (docs/semantics.md) for a query and a whole segment other than its own, whose keys share one modality
// and document: whether the query sees it (before its window). A query's own segment is the self policy, k <= q +
// self_reach, and the window is k > q - window: both bounds on the key, so a query row's allowed keys within one
// segment are one interval, and a partial tile's mask is a union of intervals, one per row and run of a segment
// (the Hopper forward's run path). `allowed` is the same rule per pair.
template <typename Tables>
__device__ __forceinline__ bool sees_other_segment(const RowRule& rule, int query_segment, int query_document,
                                                   int key_segment, int key_modality, int key_document) {
  const uint32_t bits = key_segment < query_segment ? rule.sees_earlier : rule.sees_later;
  bool ok = ((bits >> key_modality) & 1u) != 0u;
  if constexpr (Tables::kIsolatedDocuments) ok &= key_document == query_document;  // documents: isolated
  return ok;
}

}  // namespace omnigen
