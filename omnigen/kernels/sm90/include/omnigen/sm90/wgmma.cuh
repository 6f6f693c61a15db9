// omnigen sm90 primitive: warpgroup matrix multiply-accumulate (wgmma) and what surrounds it.
//
// A warpgroup (4 consecutive warps, the first a multiple of 4) multiplies a 64 x 16 A by a 16 x N B into
// a 64 x N fp32 accumulator held in registers: warp w of the group owns rows 16w..16w+15 in the same
// fragment layout as mma.sync's m16n8 accumulator, repeated over N in blocks of 8 columns. B (and A when
// not in registers) is read from shared memory through a 64-bit descriptor. The per-N instructions
// themselves are rendered into each kernel file (their register lists depend on N).
#pragma once
#include <cstdint>

namespace omnigen::sm90 {

// Shared-memory layout of a 16-bit tile as TMA writes it with the 128-byte swizzle: boxes of
// [rows][64 columns], each row 128 bytes, 8-row groups 1024 bytes apart.
//  K-major operand (Q, K: the reduction dim is contiguous): advance 32 bytes per k16 step inside a box.
//  MN-major operand (V in P.V: the output dim is contiguous): advance 16 rows (2048 bytes) per k16
//  step; the next 64 output columns are one box further (`leading` bytes).
// `swizzle_bytes`: the swizzle's period, 128 (every tile but one) or 64 (FP8's V^T in 64-key boxes, rows of 64 bytes,
// 8-row groups 512 bytes apart).
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t address, uint32_t leading_bytes, uint32_t stride_bytes,
                                                    int swizzle_bytes = 128) {
  uint64_t descriptor = 0;
  descriptor |= uint64_t((address & 0x3FFFF) >> 4);
  descriptor |= uint64_t((leading_bytes & 0x3FFFF) >> 4) << 16;
  descriptor |= uint64_t((stride_bytes & 0x3FFFF) >> 4) << 32;
  descriptor |= uint64_t(swizzle_bytes == 64 ? 2 : 1) << 62;  // layout type: 1 the 128-byte swizzle, 2 the 64-byte one
  return descriptor;
}

// The descriptor of the same layout `bytes` further on (a multiple of 16): only the start address field
// (bits 0-13, in 16-byte units) moves, and shared memory (< 256 KB) never carries out of it. One integer add
// per product, where building each descriptor from its address took eight instructions.
__device__ __forceinline__ uint64_t advance(uint64_t descriptor, uint32_t bytes) {
  const uint32_t low = uint32_t(descriptor) + (bytes >> 4);
  return (descriptor & 0xFFFFFFFF00000000ull) | low;
}

// Orders register and shared-memory accesses before the next wgmma reads its operands.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}

// Ties accumulator registers to this point: the compiler may not move their reads or writes across it
// (wgmma runs asynchronously; only wgmma_wait says its registers are ready).
template <int N>
__device__ __forceinline__ void fence_registers(float (&registers)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(registers[i])::"memory");
}

// The same value, unknown to the optimiser: a shared-memory address passed through this each step keeps
// ptxas from hoisting every descriptor of a loop-invariant tile (K, V) out of the loop, where dozens of
// 64-bit descriptors would take registers the accumulators need (and spill).
__device__ __forceinline__ uint32_t opaque(uint32_t value) {
  asm volatile("" : "+r"(value));
  return value;
}

// Registers per thread of the warpgroups that run this code (sm_90a; the kernel must be launched with a
// register cap, __launch_bounds__(threads, 1)).
template <int Registers>
__device__ __forceinline__ void grow_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void shrink_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers));
}

}  // namespace omnigen::sm90
