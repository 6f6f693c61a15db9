// omnigen: the backward's passes around its kernels, the same for every kernel family: before them Delta =
// rowsum(dO * O) in fp32 (zeroing the fp32 dQ and the backward's counters in the same pass), after them the fp32
// gradients converted to the element type; and the element type's pairs as floats.
#pragma once
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "omnigen/backward_args.h"
#include "omnigen/fragment.cuh"

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
  // The backward adds dQ into fp32 rows the caller used to zero with a pass of its own (a launch and, on the host,
  // an allocation's fill): the same rows, 8 floats a thread, while this pass's reads are in flight.
  if (args.dq_accum != nullptr && row < rows) {
    float4* zeros = reinterpret_cast<float4*>(args.dq_accum + row * kHeadDim + chunk * 8);
    zeros[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    zeros[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // The backward's int32 counters (its kv-tile counter, deterministic mode's semaphores): one a thread, in place of a
  // fill launch of their own (launch_delta checks that the grid has a thread for each).
  if (index < args.zero_int_count) args.zero_ints[index] = 0;
}

// Queues the Delta kernel on `stream`; the launch's error, if any.
template <typename Element, int kHeadDim>
cudaError_t launch_delta(const DeltaArgs& args, cudaStream_t stream) {
  const int64_t threads = int64_t(args.batch) * args.heads_q * args.seq_len * (kHeadDim / 8);
  if (args.zero_int_count > threads || (args.zero_int_count > 0 && args.zero_ints == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int blocks = int((threads + kDeltaThreads - 1) / kDeltaThreads);
  delta_kernel<Element, kHeadDim><<<blocks, kDeltaThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

constexpr int kConvertThreads = 256;

// One 16-byte chunk of the destination (8 elements, 32 bytes of fp32 read) a thread; rows of the source are
// contiguous, the destination's rows sit where its strides put them (the ops return [B, S, H, D] storage).
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kConvertThreads) convert_kernel(const ConvertArgs args) {
  constexpr int kChunks = kHeadDim / 8;
  const int64_t index = int64_t(blockIdx.x) * kConvertThreads + threadIdx.x;
  const int64_t row = index / kChunks;
  if (row >= int64_t(args.batch) * args.heads * args.seq_len) return;
  const int chunk = int(index % kChunks);
  const int position = int(row % args.seq_len);
  const int64_t batch_head = row / args.seq_len;
  const int head = int(batch_head % args.heads), batch = int(batch_head / args.heads);
  const float4* source = reinterpret_cast<const float4*>(args.source + row * kHeadDim + chunk * 8);
  const float4 low = __ldcs(source), high = __ldcs(source + 1);  // read once: not kept in L2
  // Interleaved (the Hopper backward's dQ): low holds columns 0, 2, 4, 6 of the chunk and high 1, 3, 5, 7.
  const uint4 packed = args.interleaved
                           ? make_uint4(pack<Element>(low.x, high.x), pack<Element>(low.y, high.y),
                                        pack<Element>(low.z, high.z), pack<Element>(low.w, high.w))
                           : make_uint4(pack<Element>(low.x, low.y), pack<Element>(low.z, low.w),
                                        pack<Element>(high.x, high.y), pack<Element>(high.z, high.w));
  Element* destination = static_cast<Element*>(args.destination) + batch * args.destination_stride_b +
                         head * args.destination_stride_h + position * args.destination_stride_s + chunk * 8;
  *reinterpret_cast<uint4*>(destination) = packed;
}

// Queues the conversion on `stream`; the launch's error, if any.
template <typename Element, int kHeadDim>
cudaError_t launch_convert(const ConvertArgs& args, cudaStream_t stream) {
  const int64_t threads = int64_t(args.batch) * args.heads * args.seq_len * (kHeadDim / 8);
  if (threads == 0) return cudaSuccess;
  const int64_t blocks = (threads + kConvertThreads - 1) / kConvertThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  convert_kernel<Element, kHeadDim><<<unsigned(blocks), kConvertThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace omnigen
