// Python bindings of cudasnap._C: one init_<component>(m) per component,
// defined in bindings*.cpp. These files only bind: argument conversion and
// GIL handling; the logic lives in the component sources.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../file_restore.h"

namespace cudasnap::bindings {

// Shared by the restore bindings (bindings_staging.cpp, the CUDA ones): a scatter's
// figures as a dict, its options, and (dst, offset, bytes) tuples as spans.
pybind11::dict scatter_stats_dict(const ScatterStats& st);
ScatterOptions scatter_options(int threads, uint64_t io_bytes, bool direct,
                               FileReadAhead* ahead = nullptr);
std::vector<HostSpan> host_spans(
    const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& spans);

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
