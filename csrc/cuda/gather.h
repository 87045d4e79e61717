// Gather kernel: copies many small device ranges into mapped pinned host
// memory in one launch (instead of one cudaMemcpyAsync per range). Optional,
// off by default in CudaCopyEngine.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace cudasnap {

struct GatherDesc {
  uint64_t src;     // device address
  uint64_t dst;     // device-visible address of the (mapped) host destination
  uint64_t nbytes;
};

// `descs` must be device-accessible (e.g. mapped pinned host memory). One CTA
// per descriptor; returns the launch status.
cudaError_t launch_gather(const GatherDesc* descs, int n, cudaStream_t stream);

}  // namespace cudasnap
