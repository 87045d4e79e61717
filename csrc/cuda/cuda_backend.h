// CUDA backend entry points (compiled only with CUDASNAP_WITH_CUDA).
#pragma once

namespace cudasnap {

// Number of visible CUDA devices; 0 when no driver or device is present.
int cuda_device_count();

}  // namespace cudasnap
