// Python bindings of cudasnap._C: one init_<component>(m) per component,
// defined in bindings*.cpp. These files only bind: argument conversion and
// GIL handling; the logic lives in the component sources.
#pragma once

#include <pybind11/pybind11.h>

namespace cudasnap::bindings {

void init_errors(pybind11::module_& m);
void init_crc(pybind11::module_& m);
void init_staging(pybind11::module_& m);
void init_copy_plan(pybind11::module_& m);
void init_copy_engine(pybind11::module_& m);
void init_flusher(pybind11::module_& m);
void init_layout_check(pybind11::module_& m);
void init_signals(pybind11::module_& m);
void init_allocator_tracker(pybind11::module_& m);
#ifdef CUDASNAP_WITH_CUDA
void init_cuda_backend(pybind11::module_& m);
#endif
void init_test_hooks(pybind11::module_& m);
void init_build_info(pybind11::module_& m);

}  // namespace cudasnap::bindings
