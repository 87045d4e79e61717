#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include "../error.h"

namespace cudasnap {

int cuda_device_count() {
  int n = 0;
  cudaError_t st = cudaGetDeviceCount(&n);
  if (st == cudaErrorNoDevice || st == cudaErrorInsufficientDriver) {
    (void)cudaGetLastError();
    return 0;
  }
  CUDASNAP_CUDA_CHECK(st);
  return n;
}

}  // namespace cudasnap
