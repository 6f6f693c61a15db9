// omnigen primitive: asynchronous global -> shared copies (cp.async, sm_80+).
// Thin PTX wrappers; the kernels decide what to copy and when to wait.
#pragma once
#include <cstdint>

namespace omnigen {

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes, bypassing L1 (.cg). When `valid` is false nothing is read and the 16 shared bytes
// become zeros: tails of the sequence load as zeros without a branch around the copy.
// `shared` is a 32-bit shared-space byte address (shared_address).
__device__ __forceinline__ void cp_async_16(uint32_t shared, const void* global, bool valid) {
  const int source_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(global), "r"(source_bytes));
}

// 4 bytes through L1 (.ca; .cg only exists for 16), zero-filled when `valid` is false.
__device__ __forceinline__ void cp_async_4(void* shared, const void* global, bool valid) {
  const int source_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(shared)), "l"(global),
               "r"(source_bytes));
}

// blockIdx.x / .y / .z read so that the compiler cannot hoist what is computed from them out of a
// loop (asm volatile is never moved): a kernel short of registers recomputes instead of holding.
__device__ __forceinline__ int block_index_x() {
  int value;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(value));
  return value;
}
__device__ __forceinline__ int block_index_y() {
  int value;
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(value));
  return value;
}
__device__ __forceinline__ int block_index_z() {
  int value;
  asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(value));
  return value;
}

// Close the group of copies issued so far; wait_group<N> waits until at most N groups are pending.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPendingGroups>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups));
}

// One turn of a multi-buffered cp.async pipeline: once every warp is done with the buffer consumed a step ago,
// issue the copies of step `next` into it (load(next), if next < end) as one more commit group, then wait until
// at most kInFlight groups are pending (this step's has landed) and make it visible to every warp.
template <int kInFlight, typename Load>
__device__ __forceinline__ void pipeline_turn(int next, int end, Load&& load) {
  __syncthreads();
  if (next < end) load(next);
  cp_async_commit();
  cp_async_wait<kInFlight>();
  __syncthreads();
}

}  // namespace omnigen
