// Stream-capture mode of cudasnap's own CUDA calls.
//
// A CUDA graph capture in the default cudaStreamCaptureModeGlobal mode (torch's
// torch.cuda.graph default) is invalidated by any "potentially unsafe" call
// (cudaMalloc, cudaHostAlloc, cudaHostRegister/Unregister, cudaFreeHost,
// cudaEventQuery/Synchronize, cudaStreamQuery/Synchronize, ...) made by any
// thread whose own mode is Global. cudasnap's copy-engine completion thread
// polls events, and the arena preparer registers or allocates pinned memory,
// at moments the trainer does not choose: they must never break a capture the
// trainer runs meanwhile. None of these calls touches a capturing stream, so
// relaxed mode is correct for them (CUDA Programming Guide, "Cross-stream
// dependencies and capture modes"; torch's caching allocator does the same
// around its own cudaFree / cudaEventQuery calls: CUDAStreamCaptureModeGuard).
#pragma once

#include <cuda_runtime_api.h>

#include "../error.h"

namespace cudasnap {

// Sets the calling thread's capture mode to `mode` (default: relaxed) for the
// guard's lifetime, then restores the previous one. The constructor checks the
// status (CudaError); NoThrow guards (destructors, noexcept paths, calls whose
// own error explains an unusable runtime better) leave the mode as it was on
// a failure, clear the runtime's last error, and report it in status().
class CaptureModeGuard {
 public:
  explicit CaptureModeGuard(cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed) {
    cudaStreamCaptureMode m = mode;
    CUDASNAP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&m));
    prev_ = m;
    active_ = true;
  }
  struct NoThrow {};
  CaptureModeGuard(NoThrow, cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed) noexcept {
    cudaStreamCaptureMode m = mode;
    status_ = cudaThreadExchangeStreamCaptureMode(&m);
    if (status_ == cudaSuccess) {
      prev_ = m;
      active_ = true;
    } else {
      (void)cudaGetLastError();
    }
  }
  cudaError_t status() const { return status_; }
  ~CaptureModeGuard() {
    if (!active_) return;
    cudaStreamCaptureMode m = prev_;
    if (cudaThreadExchangeStreamCaptureMode(&m) != cudaSuccess) (void)cudaGetLastError();
  }
  CaptureModeGuard(const CaptureModeGuard&) = delete;
  CaptureModeGuard& operator=(const CaptureModeGuard&) = delete;

 private:
  cudaStreamCaptureMode prev_ = cudaStreamCaptureModeGlobal;
  cudaError_t status_ = cudaSuccess;
  bool active_ = false;
};

}  // namespace cudasnap
