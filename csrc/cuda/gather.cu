#include "gather.h"

namespace cudasnap {

namespace {

__global__ void gather_kernel(const GatherDesc* __restrict__ descs) {
  const GatherDesc d = descs[blockIdx.x];
  const uint64_t n = d.nbytes;
  const uint64_t tid = threadIdx.x, nt = blockDim.x;
  if (((d.src | d.dst | n) & 15u) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(d.src);
    uint4* t = reinterpret_cast<uint4*>(d.dst);
    for (uint64_t i = tid; i < n / 16; i += nt) t[i] = s[i];
  } else if (((d.src | d.dst | n) & 3u) == 0) {
    const uint32_t* s = reinterpret_cast<const uint32_t*>(d.src);
    uint32_t* t = reinterpret_cast<uint32_t*>(d.dst);
    for (uint64_t i = tid; i < n / 4; i += nt) t[i] = s[i];
  } else {
    const unsigned char* s = reinterpret_cast<const unsigned char*>(d.src);
    unsigned char* t = reinterpret_cast<unsigned char*>(d.dst);
    for (uint64_t i = tid; i < n; i += nt) t[i] = s[i];
  }
}

}  // namespace

cudaError_t launch_gather(const GatherDesc* descs, int n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  gather_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(descs);
  return cudaGetLastError();
}

}  // namespace cudasnap
