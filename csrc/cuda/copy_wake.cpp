#include "copy_wake.h"

namespace cudasnap {

namespace {

// Runs on the stream: makes no CUDA call, as cudaLaunchHostFunc requires.
void CUDART_CB wake_host_fn(void* p) {
  auto* ref = static_cast<std::shared_ptr<CopyWake>*>(p);
  (*ref)->notify();
  delete ref;
}

}  // namespace

cudaError_t wake_after(cudaStream_t stream, const std::shared_ptr<CopyWake>& wake) {
  auto* ref = new std::shared_ptr<CopyWake>(wake);
  cudaError_t st = cudaLaunchHostFunc(stream, wake_host_fn, ref);
  if (st != cudaSuccess) delete ref;
  return st;
}

}  // namespace cudasnap
