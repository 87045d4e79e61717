// Python bindings of cudasnap._C: one init_<component>(m) per component,
// defined in bindings*.cpp. These files only bind: argument conversion and
// GIL handling; the logic lives in the component sources.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <tuple>
#include <vector>

#include "../file_restore.h"

namespace cudasnap::bindings {

// A stats struct as a dict, one way everywhere: to_dict(s, field("key", &S::member), ...)
// makes {"key": s.member, ...} in the order given. A field reads a data member, or a callable
// that takes the struct (for a value worked out from it, such as a name for a state code).
// Each value is converted as pybind11 converts its C++ type (an integer stays int, a double
// float, a vector a list). Holds the GIL: call it after any gil_scoped_release has ended.
template <typename Get>
struct Field {
  const char* key;
  Get get;
};
template <typename Get>
constexpr Field<Get> field(const char* key, Get get) {
  return {key, get};
}
template <typename S, typename... Get>
pybind11::dict to_dict(const S& s, const Field<Get>&... fields) {
  pybind11::dict d;
  ((d[fields.key] = std::invoke(fields.get, s)), ...);
  return d;
}

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
