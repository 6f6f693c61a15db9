// omnigen primitive: fp32 atomic accumulation into global memory (the FlashAttention-2 dQ buffer).
#pragma once

namespace omnigen {

// to[0] += x, to[1] += y; `to` 8-byte aligned. One vector atomic on sm_90+, two scalar ones before.
__device__ __forceinline__ void atomic_add_pair(float* to, float x, float y) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(to), make_float2(x, y));
#else
  atomicAdd(to, x);
  atomicAdd(to + 1, y);
#endif
}

// to[0..3] += v; `to` 16-byte aligned. One vector atomic on sm_90+, four scalar ones before.
__device__ __forceinline__ void atomic_add_four(float* to, float4 v) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(to), v);
#else
  atomicAdd(to, v.x);
  atomicAdd(to + 1, v.y);
  atomicAdd(to + 2, v.z);
  atomicAdd(to + 3, v.w);
#endif
}

}  // namespace omnigen
