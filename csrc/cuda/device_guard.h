// DeviceGuard: makes `device` current for a scope, and makes no CUDA context on
// any other device — neither on the way in nor on the way back.
//
// Since CUDA 12.0 cudaSetDevice initialises the primary context of the device
// it names. A thread that never chose a device (cudasnap's own threads, the
// arena preparer, a GC or atexit thread) has device 0 current: restoring that
// "previous" device would make a context on GPU 0 from every rank of a node.
// As torch does (c10::cuda::MaybeExchangeDevice), the previous device is made
// current again only where it already has a primary context
// (cuDevicePrimaryCtxGetState, through the runtime's driver entry point);
// otherwise `device` stays current. Header-only: both CUDA sources use it.
#pragma once

#include <cuda_runtime_api.h>

#include "../error.h"

namespace cudasnap {

namespace device_guard_detail {
using PrimaryCtxGetState = int (*)(int dev, unsigned* flags, int* active);

inline PrimaryCtxGetState primary_ctx_get_state() {
  static PrimaryCtxGetState fn = [] {
    void* p = nullptr;
#if CUDART_VERSION >= 12050
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t st = cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &p, 12000,
                                                      cudaEnableDefault, &q);
    const bool found = q == cudaDriverEntryPointSuccess;
#elif CUDART_VERSION >= 12000
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t st = cudaGetDriverEntryPoint("cuDevicePrimaryCtxGetState", &p, cudaEnableDefault, &q);
    const bool found = q == cudaDriverEntryPointSuccess;
#else  // CUDA 11.x (torch cu118 wheels): no query result
    cudaError_t st = cudaGetDriverEntryPoint("cuDevicePrimaryCtxGetState", &p, cudaEnableDefault);
    const bool found = p != nullptr;
#endif
    if (st != cudaSuccess || !found || !p) {
      (void)cudaGetLastError();
      return PrimaryCtxGetState{nullptr};
    }
    return reinterpret_cast<PrimaryCtxGetState>(p);
  }();
  return fn;
}
}  // namespace device_guard_detail

// True when `device` has a primary context (or when that cannot be asked: then
// restoring is the safe default, as before this guard existed).
inline bool has_primary_context(int device) {
  auto fn = device_guard_detail::primary_ctx_get_state();
  if (!fn) return true;
  unsigned flags = 0;
  int active = 0;
  return fn(device, &flags, &active) != 0 || active != 0;
}

class DeviceGuard {
 public:
  struct NoThrow {};
  explicit DeviceGuard(int device) : device_(device) {
    CUDASNAP_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device_) CUDASNAP_CUDA_CHECK(cudaSetDevice(device_));
  }
  // For teardown paths (destructors, atexit): errors are ignored.
  DeviceGuard(int device, NoThrow) : device_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device_ && cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != device_ && has_primary_context(prev_)) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int prev_ = -1;
};

}  // namespace cudasnap
