// omnigen: the forward kernel's arguments, shared by the generated binding (host C++, no CUDA headers), the generated
// kernel files and the op shim. Pointers are device addresses; strides count elements.
// Generated from omnigen/kernels/arguments.py (python -m omnigen.kernels.arguments --write): edit that, not this.
#pragma once
#include <cstdint>

namespace omnigen {

// What one forward launch reads and writes.
struct ForwardArgs {
  const void* q;                  // [batch, heads_q, seq_len, head_dim], bf16/fp16 (or e4m3: forward), last dim contiguous
  const void* k;                  // [batch, heads_kv, seq_len, head_dim]
  const void* v;                  // [batch, heads_kv, seq_len, head_dim]
  void* o;                        // [batch, heads_q, seq_len, head_dim]
  float* lse;                     // [batch, heads_q, seq_len], float32, contiguous
  int64_t q_stride_b, q_stride_h, q_stride_s;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t v_stride_b, v_stride_h, v_stride_s;
  int64_t o_stride_b, o_stride_h, o_stride_s;
  int batch, heads_q, heads_kv, seq_len;
  float scale;                    // softmax scale, usually 1/sqrt(head_dim)
  const int32_t* fwd_ptr;         // omnigen.Plan.fwd_ptr: [batch * num_q_tiles * 3 + 1]
  const int32_t* fwd_kv;          // omnigen.Plan.fwd_kv (empty, address 0, when the plan visits no tile)
  const int32_t* token_segment;   // LayoutTables.token_segment [batch, seq_len]
  const int32_t* token_modality;  // LayoutTables.token_modality [batch, seq_len]
  const int32_t* token_doc;       // LayoutTables.token_doc [batch, seq_len]
  int32_t* tile_counter;          // the persistent sm90 forward's work-tile counter: one int32, zeroed by the launch; else null
  // Partial tiles' masks made once per layout (omnigen.plan.bits; the sm90 forward): the slot of each q-tile row's
  // first partial entry [batch * num_q_tiles + 1], and `partial_slots` slots of bits. 0 slots: none (null pointers).
  const int32_t* partial_slot;
  const uint32_t* partial_bits;
  int partial_slots;
  float value_scale;              // FP8 (e4m3) variants: V's descale, multiplied into O; other variants ignore it
  const float* descale;           // FP8 (e4m3) variants: null, or (dq, dk, dv) in float32 on the device, read in place of the host's
};

// Implemented by the generated kernel file. Each returns 0 or a CUDA error code, and fills `message`
// (at most `message_size` bytes, NUL-terminated) with a sentence for the user when it fails.
int forward_launch(const ForwardArgs& args, uintptr_t stream, char* message, int message_size);
int device_check(char* message, int message_size);

}  // namespace omnigen
