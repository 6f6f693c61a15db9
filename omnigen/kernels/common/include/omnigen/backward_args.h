// omnigen: the backward kernels' arguments, shared by the generated binding (host C++, no CUDA headers), the generated
// kernel files and the op shim. Pointers are device addresses; strides count elements.
// Generated from omnigen/kernels/arguments.py (python -m omnigen.kernels.arguments --write): edit that, not this.
#pragma once
#include <cstdint>

namespace omnigen {

// What one backward launch (the dK/dV kernel, and the dQ kernel where separate) reads and writes.
struct BackwardArgs {
  const void* q;                  // [batch, heads_q, seq_len, head_dim], bf16/fp16 (or e4m3: forward), last dim contiguous
  const void* k;                  // [batch, heads_kv, seq_len, head_dim]
  const void* v;                  // [batch, heads_kv, seq_len, head_dim]
  const void* d_o;                // upstream gradient of the output, [batch, heads_q, seq_len, head_dim]
  const float* lse;               // the forward's log-sum-exp, [batch, heads_q, seq_len], float32, contiguous
  const float* delta;             // rowsum(dO * O), [batch, heads_q, seq_len], float32, contiguous
  float* dq_accum;                // dQ, [batch, heads_q, seq_len, head_dim], float32, contiguous (zeroed by the caller)
  // dK and dV of every *query* head: [batch, heads_q, seq_len, head_dim]. The element type of q/k/v when
  // heads_q == heads_kv (then they are the real dk/dv); float32 partials the caller sums over each group
  // of heads_q / heads_kv query heads when they differ.
  void* dk;
  void* dv;
  int64_t q_stride_b, q_stride_h, q_stride_s;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t v_stride_b, v_stride_h, v_stride_s;
  int64_t d_o_stride_b, d_o_stride_h, d_o_stride_s;
  int64_t dk_stride_b, dk_stride_h, dk_stride_s;
  int64_t dv_stride_b, dv_stride_h, dv_stride_s;
  int batch, heads_q, heads_kv, seq_len;
  float scale;                    // the forward's softmax scale
  const int32_t* fwd_ptr;         // omnigen.Plan.fwd_ptr (read by the deterministic dQ kernel only)
  const int32_t* fwd_kv;          // omnigen.Plan.fwd_kv
  const int32_t* bwd_ptr;         // omnigen.Plan.bwd_ptr: [batch * num_kv_tiles * 3 + 1]
  const int32_t* bwd_q;           // omnigen.Plan.bwd_q (empty, address 0, when the plan visits no tile)
  const int32_t* token_segment;   // LayoutTables.token_segment [batch, seq_len]
  const int32_t* token_modality;  // LayoutTables.token_modality [batch, seq_len]
  const int32_t* token_doc;       // LayoutTables.token_doc [batch, seq_len]
  int deterministic;              // 0: dQ by atomicAdd from the dK/dV kernel; 1: a second kernel per q-tile, no atomics
  // Deterministic mode of modules whose Hopper backward orders its dQ additions (ORDERED_DQ): each
  // backward-schedule entry's rank among its q-tile's kv-tiles (omnigen.Plan.dq_ranks, parallel to bwd_q) and
  // one zeroed counter per (batch, query head, 64-row block of dQ); in atomic mode the persistent backward's
  // kv-tile counter, one zeroed int32 (PERSISTENT_BACKWARD). Null otherwise. The Delta pass zeroes them (zero_ints).
  const int32_t* dq_rank;
  int32_t* dq_semaphore;
  // GQA's dK/dV: 0 or 1, float32 per query head (the caller sums each group); heads_q / heads_kv (a power of two):
  // added by the Hopper backward into float32 [batch, heads_kv, seq_len, head_dim] (GROUP_DKDV modules, atomic mode).
  int dkdv_group;
  // The Hopper backward's partial steps: the mask's bits of the backward schedule (omnigen.plan.bits, transposed
  // tiles), the slot of each kv-tile column's first partial entry [batch * num_kv_tiles + 1]. 0 slots: none.
  const int32_t* partial_slot;
  const uint32_t* partial_bits;
  int partial_slots;
};

// rowsum(dO * O) per query row, the Delta the backward reads; and the fp32 dQ zeroed in the same pass.
struct DeltaArgs {
  const void* o;           // [batch, heads_q, seq_len, head_dim]
  const void* d_o;         // [batch, heads_q, seq_len, head_dim]
  float* delta;            // [batch, heads_q, seq_len], float32, contiguous
  int64_t o_stride_b, o_stride_h, o_stride_s;
  int64_t d_o_stride_b, d_o_stride_h, d_o_stride_s;
  int batch, heads_q, seq_len;
  float* dq_accum;         // null, or the backward's [batch, heads_q, seq_len, head_dim] float32 to zero
  int32_t* zero_ints;      // null, or int32 counters the backward takes zeroed (BackwardArgs.dq_semaphore), zeroed here too
  int64_t zero_int_count;  // how many: at most batch * heads_q * seq_len
};

// A gradient accumulated in float32 (dQ, GQA's grouped dK/dV) written out in the element type.
struct ConvertArgs {
  const float* source;  // [batch, heads, seq_len, head_dim], float32, contiguous
  void* destination;    // [batch, heads, seq_len, head_dim], the element type, last dim contiguous
  int64_t destination_stride_b, destination_stride_h, destination_stride_s;
  int batch, heads, seq_len;
  int interleaved;      // 1: each 8-column group of the source holds columns 0, 2, 4, 6, 1, 3, 5, 7 (dQ of a module whose DQ_INTERLEAVED is set); 0: in order
};

// Implemented by the generated backward kernel file; same conventions as forward_launch.
int backward_launch(const BackwardArgs& args, uintptr_t stream, char* message, int message_size);
int backward_delta_launch(const DeltaArgs& args, uintptr_t stream, char* message, int message_size);
int backward_convert_launch(const ConvertArgs& args, uintptr_t stream, char* message, int message_size);

}  // namespace omnigen
