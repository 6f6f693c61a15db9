// omnigen primitive: the layout's per-token tables (LayoutTables: segment, modality, document) of a run of
// rows, as the kernels keep them in shared memory for the partial path (the rules' predicate reads them).
#pragma once
#include <cstdint>

namespace omnigen {

template <int kRows>
struct TokenTables {
  int32_t segment[kRows];
  int32_t modality[kRows];
  int32_t document[kRows];  // filled and read only when the rules isolate documents
};

// The tables of the kRows tokens at positions start, start + 1, ... of one batch element (its tables begin at
// token `slice` of args.token_*), with plain loads by a block of kThreads threads: for tables read once per
// CTA, with no copy in flight to overlap. Positions at or past seq_len are pad (segment -1, modality
// `pad_modality`): the predicate lets them see nothing.
template <int kRows, int kThreads, bool kDocuments, typename Args>
__device__ __forceinline__ void load_tokens(TokenTables<kRows>& tables, const Args& args, int64_t slice, int start,
                                            int seq_len, int pad_modality) {
  for (int row = threadIdx.x; row < kRows; row += kThreads) {
    const int position = start + row;
    const bool valid = position < seq_len;
    tables.segment[row] = valid ? __ldg(args.token_segment + slice + position) : -1;
    tables.modality[row] = valid ? __ldg(args.token_modality + slice + position) : pad_modality;
    if constexpr (kDocuments) tables.document[row] = valid ? __ldg(args.token_doc + slice + position) : -1;
  }
}

}  // namespace omnigen
