// omnigen sm90 primitive: the tensor memory accelerator (TMA). A tensor map, encoded once on the host,
// describes a 4-D tensor [batch][heads][seq][head_dim] in global memory (any strides, last dim
// contiguous) and the box one copy moves: 128 bytes of columns (64 of 16-bit elements, 128 of 8-bit ones; the
// 128-byte swizzle's width) x `rows` rows. Rows past the end of the tensor arrive as zeros and are never written back.
#pragma once
#include <cstdint>
#include <cstdio>

#include <cuda.h>
#include <cuda_runtime.h>

#include "omnigen/sm90/barrier.cuh"

namespace omnigen::sm90 {

constexpr int kBoxColumns = 64;    // head-dim columns per box: 128 bytes of 16-bit elements
constexpr int kBoxRowBytes = 128;  // one box row, and the swizzle's period

// ---- device ------------------------------------------------------------------------------------

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// One box [rows][64] at (column, row, head, batch) into shared memory; completes `bytes` on `barrier`.
__device__ __forceinline__ void load_box(void* destination, const CUtensorMap* map, uint64_t* barrier, int column,
                                         int row, int head, int batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(shared_address(destination)), "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(head),
        "r"(batch), "r"(shared_address(barrier))
      : "memory");
}

// `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) into shared memory, completing
// on `barrier` like a tensor copy: how the producer brings a kv-tile's per-token tables along.
__device__ __forceinline__ void load_bytes(void* destination, const void* source, uint32_t bytes, uint64_t* barrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(shared_address(destination)), "l"(reinterpret_cast<uint64_t>(source)), "r"(bytes),
                 "r"(shared_address(barrier))
               : "memory");
}

// The rows a bulk copy cannot take (unaligned, or running past the end of the sequence) copied by the calling
// thread with plain loads and stores; the caller's later mbarrier arrival releases them to the waiting threads.
template <typename T>
__device__ __forceinline__ void copy_rows(T* destination, const T* source, int rows) {
#pragma unroll 1
  for (int i = 0; i < rows; ++i) destination[i] = source[i];
}

// `source` (one box as `map` describes it, in shared memory) added element-wise into global memory at
// (column, row, head, batch) by the TMA unit; rows past the end of the tensor are dropped. The operation
// joins this thread's bulk async-group (bulk_commit, then bulk_wait_read before `source` is written again).
__device__ __forceinline__ void reduce_add_box(const CUtensorMap* map, const void* source, int column, int row, int head,
                                               int batch) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      ::"l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(source)), "r"(column), "r"(row), "r"(head), "r"(batch)
      : "memory");
}

// `source` (one box as `map` describes it, in shared memory) written into global memory at (column, row, head,
// batch) by the TMA unit; rows past the end of the tensor are dropped. Joins this thread's bulk async-group, like
// reduce_add_box.
__device__ __forceinline__ void store_box(const CUtensorMap* map, const void* source, int column, int row, int head,
                                          int batch) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(source)), "r"(column), "r"(row), "r"(head),
                 "r"(batch)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// This thread's bulk groups but the newest `Pending` have read their shared memory (it may be rewritten).
template <int Pending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(Pending) : "memory");
}

// This thread's bulk groups but the newest `Pending` are complete, writes included.
template <int Pending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(Pending) : "memory");
}

// Four 8 x 8 matrices of 16-bit elements into shared memory (stmatrix .x4): this lane's register m holds row lane / 4,
// elements 2 (lane % 4) and + 1, of matrix m, as an mma accumulator fragment does; lane 8 m + r gives the address of
// row r of matrix m.
__device__ __forceinline__ void store_matrices(uint32_t address, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], { %1, %2, %3, %4 };\n"
               ::"r"(address), "r"(m0), "r"(m1), "r"(m2), "r"(m3)
               : "memory");
}

// The same with one fp32 a register (as two 16-bit halves: a matrix row is then 4 fp32, lane l's at column l % 4).
// Passed as f32 registers: a b32 copy of a wgmma accumulator made ptxas serialise the wgmmas in flight (C7514).
__device__ __forceinline__ void store_matrices(uint32_t address, float m0, float m1, float m2, float m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], { %1, %2, %3, %4 };\n"
               ::"r"(address), "f"(m0), "f"(m1), "f"(m2), "f"(m3)
               : "memory");
}

// Makes this thread's ordinary shared-memory stores visible to the TMA unit and wgmma (the async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- host --------------------------------------------------------------------------------------

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's encoder, found through the runtime (the module links no libcuda of its own).
inline EncodeTiled encoder() {
  static EncodeTiled found = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult result;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &result) !=
            cudaSuccess ||
        result != cudaDriverEntryPointSuccess) {
      return EncodeTiled(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(function);
  }();
  return found;
}

// A map of a [batch][heads][seq_len][head_dim] tensor (strides in elements, the last dim contiguous) whose
// boxes are [rows][`box_bytes` bytes of columns], swizzled with the same period (128, or 64: FP8's V^T in 64-key
// boxes). Returns false (and says why in `message`) when the driver refuses it.
inline bool encode_map(CUtensorMap* map, CUtensorMapDataType type, int element_bytes, const void* base, int head_dim,
                       int seq_len, int heads, int batch, int64_t stride_s, int64_t stride_h, int64_t stride_b, int rows,
                       char* message, int message_size, int box_bytes = kBoxRowBytes) {
  const EncodeTiled encode = encoder();
  if (encode == nullptr) {
    snprintf(message, message_size, "the CUDA driver has no cuTensorMapEncodeTiled (a driver for CUDA 12 or newer is needed)");
    return false;
  }
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(seq_len), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(stride_s) * element_bytes, cuuint64_t(stride_h) * element_bytes,
                                 cuuint64_t(stride_b) * element_bytes};
  const cuuint32_t box[4] = {cuuint32_t(box_bytes / element_bytes), cuuint32_t(rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult status = encode(map, type, 4, const_cast<void*>(base), dims, strides, box, element_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 box_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    snprintf(message, message_size,
             "cuTensorMapEncodeTiled refused a [%d, %d, %d, %d] tensor with strides (%lld, %lld, %lld) elements "
             "(error %d): TMA needs a 16-byte aligned base and strides that are multiples of 16 bytes",
             batch, heads, seq_len, head_dim, (long long)stride_b, (long long)stride_h, (long long)stride_s, int(status));
    return false;
  }
  return true;
}

}  // namespace omnigen::sm90
