// omnigen: the host side every kernel file shares. Before a first launch on a device: is there a GPU,
// does this module hold code for it, does its shared memory suffice, and is the kernel's dynamic
// shared-memory limit raised (once per device)? Each failure becomes a sentence for the user.
#pragma once
#include <cstdio>

#include <cuda_runtime.h>

namespace omnigen {

// What a module says about itself in its messages.
struct ModuleFacts {
  const char* module_name;
  const char* arch;        // sm_80, sm_90a
  const char* capability;  // 8.0, 9.0
  const char* tile_hint;   // which tile fields to lower when shared memory does not suffice
};

constexpr int kMaxDevices = 64;

// A failed CUDA call as the module's error: "what: the error's text (its name)" into message; the status as an int.
inline int fail(cudaError_t status, char* message, int message_size, const char* what) {
  snprintf(message, message_size, "%s: %s (%s)", what, cudaGetErrorString(status), cudaGetErrorName(status));
  return int(status);
}

// 0 when `kernel` may be launched on the current device with `shared_bytes` of dynamic shared memory;
// `ready[device]` remembers a device that passed.
template <typename Kernel>
int ready_device(Kernel* kernel, int shared_bytes, const ModuleFacts& facts, int (&ready)[kMaxDevices],
                   char* message, int message_size) {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    snprintf(message, message_size,
             "no CUDA GPU is available (%s). This module (%s) imports without one, but running its kernel needs "
             "an NVIDIA GPU of compute capability %s and a driver.",
             status != cudaSuccess ? cudaGetErrorString(status) : "cudaGetDeviceCount found 0 devices",
             facts.module_name, facts.capability);
    return status != cudaSuccess ? int(status) : int(cudaErrorNoDevice);
  }
  int device = 0;
  status = cudaGetDevice(&device);
  if (status != cudaSuccess) return fail(status, message, message_size, "cudaGetDevice");
  if (device < kMaxDevices && ready[device]) return 0;

  cudaFuncAttributes attributes;
  status = cudaFuncGetAttributes(&attributes, kernel);
  if (status != cudaSuccess) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    cudaGetLastError();
    snprintf(message, message_size,
             "this module (%s) holds code for %s only and cannot run on GPU %d (compute capability %d.%d): "
             "build a variant for it with `omnigen build --arch sm_%d%d%s` (%s)",
             facts.module_name, facts.arch, device, major, minor, major, minor, major == 9 ? "a" : "",
             cudaGetErrorString(status));
    return int(status);
  }
  int shared_limit = 0;
  cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (shared_limit < shared_bytes) {
    snprintf(message, message_size,
             "this variant needs %d bytes of shared memory per block, GPU %d allows %d: "
             "pick a smaller tile (%s) in the rules' kernel: section",
             shared_bytes, device, shared_limit, facts.tile_hint);
    return int(cudaErrorInvalidConfiguration);
  }
  // Above 48 KiB, dynamic shared memory must be asked for explicitly, once per device.
  status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
  if (status != cudaSuccess) return fail(status, message, message_size, "cudaFuncSetAttribute");
  if (device < kMaxDevices) ready[device] = 1;
  return 0;
}

}  // namespace omnigen
