// omnigen sm90 primitive: thread-block clusters of two CTAs that write into each other's shared memory.
//
// A cluster's CTAs run at the same time on SMs of one GPC, and each may address the others' shared memory
// (distributed shared memory): `mapa` turns an address of this CTA's shared memory into the same variable's
// address in CTA `rank`. A bulk copy from this CTA's shared memory into a peer's completes its bytes on a barrier
// in the peer, as a TMA load does, so the peer waits for it exactly like for its own loads.
// Before a CTA's barriers may be signalled from outside, the whole cluster passes cluster_sync() once after they
// are initialised; before a CTA exits, once more, so that nothing of the peer's is still on its way.
#pragma once
#include <cstdint>

#include "omnigen/sm90/barrier.cuh"

namespace omnigen::sm90 {

// This CTA's rank in its cluster (0 or 1 in a pair: the x coordinate inside the cluster).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster arrives (its earlier writes released) and waits for the rest (acquired).
// All threads of a warp must call it together.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address, in the cluster's shared window, of what lies at `pointer` in CTA `rank`'s shared memory.
__device__ __forceinline__ uint32_t peer_address(const void* pointer, uint32_t rank) {
  uint32_t address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(address) : "r"(shared_address(pointer)), "r"(rank));
  return address;
}

// `bytes` (a multiple of 16) of this CTA's shared memory at `source` into the cluster address `destination`,
// completing the bytes on the barrier at cluster address `barrier` (both in the same peer CTA). The source must have
// been made visible to the async proxy (fence_async_shared) and stay unchanged until the peer has the bytes.
__device__ __forceinline__ void copy_to_peer(uint32_t destination, const void* source, uint32_t bytes, uint32_t barrier) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(destination), "r"(shared_address(source)), "r"(bytes), "r"(barrier)
               : "memory");
}

}  // namespace omnigen::sm90
