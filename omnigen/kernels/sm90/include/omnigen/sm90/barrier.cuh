// omnigen sm90 primitive: mbarriers (transaction-counted, what TMA completes on) and named barriers.
//
// An mbarrier in shared memory counts arrivals and, for TMA, bytes. Its phase flips when both reach
// zero; waiters name the parity of the phase they wait for. A freshly initialised barrier is in phase
// 0, so waiting for parity 1 passes at once: producers start with the "previous" phase of their
// empty-slot barriers completed, consumers with nothing ready.
#pragma once
#include <cstdint>

namespace omnigen::sm90 {

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void barrier_init(uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(arrivals));
}

// Makes the initialised barriers visible to the other threads and to the TMA unit.
__device__ __forceinline__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void barrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}

// One arrival, and `bytes` more to come from the TMA unit before the phase completes.
__device__ __forceinline__ void barrier_expect_bytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* barrier, uint32_t parity) {
  const uint32_t address = shared_address(barrier);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred ready;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
        "selp.u32 %0, 1, 0, ready;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (!done);
}

// Named barriers (ids 1..15; 0 is __syncthreads) among `threads` threads of the CTA.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Counters in global memory that order work across CTAs (deterministic dQ): one thread spins until the
// counter reaches `value` (acquire: what the CTAs before it wrote is then ordered before what follows), and
// one thread adds 1 when its own writes are done (release). The global writes of finished bulk copies
// (cp.async.bulk.wait_group) belong to the async proxy: fence them into the generic proxy first.
__device__ __forceinline__ void counter_wait(const int32_t* counter, int32_t value) {
  int32_t seen;
  while (true) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
    if (seen == value) return;
    __nanosleep(64);
  }
}

__device__ __forceinline__ void counter_release_add(int32_t* counter) {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

}  // namespace omnigen::sm90
