// omnigen: the backward's preprocessing step, Delta = rowsum(dO * O) in fp32, the same for every kernel family,
// and the element type's pairs as floats.
#pragma once
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "omnigen/backward_args.h"

namespace omnigen {

// Two packed 16-bit elements (low, high) as floats.
template <typename Element>
__device__ __forceinline__ float2 to_float2(uint32_t pair) {
  if constexpr (std::is_same_v<Element, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&pair));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair));
  }
}

constexpr int kDeltaThreads = 256;

// kHeadDim / 8 threads per row, one 16-byte chunk of O and dO each; a row's chunks lie in one warp.
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(const DeltaArgs args) {
  constexpr int kChunks = kHeadDim / 8;
  static_assert(32 % kChunks == 0, "a row's chunks lie in one warp");
  const int64_t index = int64_t(blockIdx.x) * kDeltaThreads + threadIdx.x;
  const int64_t row = index / kChunks;
  const int chunk = int(index % kChunks);
  const int64_t rows = int64_t(args.batch) * args.heads_q * args.seq_len;
  float sum = 0.f;
  if (row < rows) {
    const int position = int(row % args.seq_len);
    const int64_t batch_head = row / args.seq_len;
    const int head = int(batch_head % args.heads_q), batch = int(batch_head / args.heads_q);
    const Element* o = static_cast<const Element*>(args.o) + batch * args.o_stride_b + head * args.o_stride_h +
                       position * args.o_stride_s + chunk * 8;
    const Element* d_o = static_cast<const Element*>(args.d_o) + batch * args.d_o_stride_b + head * args.d_o_stride_h +
                         position * args.d_o_stride_s + chunk * 8;
    const uint4 o_chunk = __ldg(reinterpret_cast<const uint4*>(o));
    const uint4 d_o_chunk = __ldg(reinterpret_cast<const uint4*>(d_o));
    const uint32_t o_pairs[4] = {o_chunk.x, o_chunk.y, o_chunk.z, o_chunk.w};
    const uint32_t d_o_pairs[4] = {d_o_chunk.x, d_o_chunk.y, d_o_chunk.z, d_o_chunk.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = to_float2<Element>(o_pairs[i]), b = to_float2<Element>(d_o_pairs[i]);
      sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
    }
  }
#pragma unroll
  for (int offset = kChunks / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (row < rows && chunk == 0) args.delta[row] = sum;
}

// Queues the Delta kernel on `stream`; the launch's error, if any.
template <typename Element, int kHeadDim>
cudaError_t launch_delta(const DeltaArgs& args, cudaStream_t stream) {
  const int64_t threads = int64_t(args.batch) * args.heads_q * args.seq_len * (kHeadDim / 8);
  const int blocks = int((threads + kDeltaThreads - 1) / kDeltaThreads);
  delta_kernel<Element, kHeadDim><<<blocks, kDeltaThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace omnigen
