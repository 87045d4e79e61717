// Python bindings for cudasnap._C: the module, errors, CRC, layout guard,
// signals and build info. Only binds (see bindings.h).
#include "bindings.h"

#include <pybind11/stl.h>

#include "../crc32c.h"
#include "../error.h"
#include "../signals.h"
#include "../test_hooks.h"
#include "host_watch.h"
#include "layout_check.h"

namespace py = pybind11;

#ifndef CUDASNAP_VERSION
#define CUDASNAP_VERSION "0.0.0"
#endif
#ifndef CUDASNAP_CUDA_ARCHS
#define CUDASNAP_CUDA_ARCHS ""
#endif

namespace cudasnap::bindings {

namespace {

const char* python_error_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::Staging: return "StagingError";
    case ErrorKind::Corrupt: return "CorruptSnapshot";
    case ErrorKind::Incompatible: return "IncompatibleSnapshot";
    case ErrorKind::Io: return "FlushError";
    case ErrorKind::Cuda: return "CudaError";
    default: return "SnapshotError";
  }
}

}  // namespace

void init_errors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object cls = py::module_::import("cudasnap.errors").attr(python_error_name(e.kind()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
  m.def("_raise_for_test", [](int kind, const std::string& msg) {
    CUDASNAP_CHECK_KIND(static_cast<ErrorKind>(kind), false, msg);
  });
}

void init_crc(py::module_& m) {
  m.def("crc32c", [](py::buffer b, uint32_t crc) {
    py::buffer_info info = b.request();
    uint64_t n = uint64_t(info.size) * info.itemsize;
    const void* p = info.ptr;
    py::gil_scoped_release nogil;
    return crc32c(crc, p, n);
  }, py::arg("data"), py::arg("crc") = 0);
  m.def("crc32c_ptr", [](uint64_t ptr, uint64_t n) {
    py::gil_scoped_release nogil;
    return crc32c(0, reinterpret_cast<const void*>(ptr), n);
  });
  m.def("crc32c_hardware", &crc32c_hardware);
  m.def("_crc32c_impl", [](py::buffer b, const std::string& impl, uint32_t crc) {
    py::buffer_info info = b.request();
    uint64_t n = uint64_t(info.size) * info.itemsize;
    uint32_t out = 0;
    bool ok;
    {
      py::gil_scoped_release nogil;
      ok = crc32c_impl(impl.c_str(), crc, info.ptr, n, &out);
    }
    if (!ok) throw py::value_error("crc32c implementation '" + impl + "' is unknown or unsupported by this CPU");
    return out;
  }, py::arg("data"), py::arg("impl"), py::arg("crc") = 0);
  m.def("crc32c_copy", [](py::buffer dst, py::buffer src, uint32_t crc) {
    py::buffer_info d = dst.request(/*writable=*/true);
    py::buffer_info s = src.request();
    uint64_t dn = uint64_t(d.size) * d.itemsize, sn = uint64_t(s.size) * s.itemsize;
    CUDASNAP_CHECK(dn >= sn, "crc32c_copy: destination holds " << dn << " bytes, source " << sn);
    auto dp = static_cast<const uint8_t*>(d.ptr), sp = static_cast<const uint8_t*>(s.ptr);
    CUDASNAP_CHECK(dp + sn <= sp || sp + sn <= dp, "crc32c_copy: source and destination overlap");
    py::gil_scoped_release nogil;
    return crc32c_copy(crc, d.ptr, s.ptr, sn);
  }, py::arg("dst"), py::arg("src"), py::arg("crc") = 0,
     "copies src into the start of dst and returns the CRC32C of the bytes copied "
     "(continuing `crc`), reading src once");
}

void init_layout_check(py::module_& m) {
  py::class_<LayoutGuard>(m, "LayoutGuard")
      .def(py::init([](py::list tensors) { return new LayoutGuard(tensors.ptr()); }))
      .def("set_entries", [](LayoutGuard& g, py::list entries) { g.set_entries(entries.ptr()); },
           py::arg("entries"))
      .def("set_sizes", [](LayoutGuard& g, py::list owners, py::str attr) { g.set_sizes(owners.ptr(), attr.ptr()); },
           py::arg("owners"), py::arg("attr"))
      .def("set_rescan_every", &LayoutGuard::set_rescan_every, py::arg("n"))
      .def("boundary_check", &LayoutGuard::boundary_check, py::arg("count"));
  py::class_<StateWatch>(m, "StateWatch")
      .def(py::init<std::vector<std::pair<uint64_t, uint64_t>>, bool>(), py::arg("regions"),
           py::arg("torch_cpu_rng") = false)
      .def("changed", &StateWatch::changed)
      .def_property_readonly("watched_bytes", &StateWatch::watched_bytes);
  py::class_<HostWatch>(m, "HostWatch")
      .def(py::init<>())
      .def("add_watched",
           [](HostWatch& w, std::vector<std::pair<uint64_t, uint64_t>> regions, bool torch_cpu_rng,
              py::list same, py::handle gauss) {
             return w.add_watched(std::move(regions), torch_cpu_rng, same.ptr(), gauss.ptr());
           },
           py::arg("regions"), py::arg("torch_cpu_rng") = false, py::arg("same") = py::list(),
           py::arg("gauss") = py::none())
      .def("add_always", &HostWatch::add_always)
      .def("add_flag", [](HostWatch& w, py::handle obj, py::str attr) { return w.add_flag(obj.ptr(), attr.ptr()); },
           py::arg("obj"), py::arg("attr"))
      .def("unwatch", &HostWatch::unwatch, py::arg("index"))
      .def("set_optim",
           [](HostWatch& w, py::dict optimizers, py::dict scalar_keys) {
             w.set_optim(optimizers.ptr(), scalar_keys.ptr());
           },
           py::arg("optimizers"), py::arg("scalar_keys"))
      .def("changed", &HostWatch::changed)
      .def("__len__", &HostWatch::size)
      .def_property_readonly_static("OPTIM_BIT", [](py::handle) { return HostWatch::kOptimBit; });
  py::class_<ValueWatch>(m, "ValueWatch")
      .def(py::init<>())
      .def("changed", [](ValueWatch& w, py::handle v) { return w.changed(v.ptr()); },
           py::arg("value"));
}

void init_signals(py::module_& m) {
  m.def("install_signal_pipe", &install_signal_pipe, py::arg("signals"));
  m.def("uninstall_signal_pipe", &uninstall_signal_pipe);
}

void init_test_hooks(py::module_& m) {
  // TEST-ONLY (csrc/test_hooks.h); armed by cudasnap/_testing, never by the library.
  m.def(
      "_arm_test_hook",
      [](const std::string& name, const std::string& phase, long nth) {
        if (name != "kill_at") throw py::value_error("unknown test hook '" + name + "' (kill_at)");
        test_hooks::arm_kill(phase, nth);
      },
      py::arg("name"), py::arg("phase"), py::arg("nth") = 1);
  m.def("_disarm_test_hooks", &test_hooks::disarm);
  m.def("_armed_kill_phase", &test_hooks::armed_kill);
  m.def("_test_kill_phases", &test_hooks::kill_phases);
}

#ifndef CUDASNAP_TORCH_VERSION
#define CUDASNAP_TORCH_VERSION "unknown"
#endif
// The torch this library was built against, also readable from the file
// without loading it (cudasnap/_native.py looks for the marker prefix).
const char kBuiltWithTorch[] = "cudasnap-built-with-torch:" CUDASNAP_TORCH_VERSION;

void init_build_info(py::module_& m) {
  py::dict info;
  info["version"] = CUDASNAP_VERSION;
  info["torch"] = kBuiltWithTorch + sizeof("cudasnap-built-with-torch:") - 1;
  py::list backends;
  backends.append("cpu");
#ifdef CUDASNAP_WITH_CUDA
  backends.append("cuda");
  info["cuda_version"] = CUDASNAP_CUDA_VERSION_STRING;
#else
  info["cuda_version"] = py::none();
#endif
  info["backends"] = backends;
  info["cuda_architectures"] = CUDASNAP_CUDA_ARCHS;
  info["crc32c_hardware"] = crc32c_hardware();
  m.attr("BUILD_INFO") = info;
}

}  // namespace cudasnap::bindings

PYBIND11_MODULE(_C, m) {
  using namespace cudasnap::bindings;
  m.doc() = "cudasnap private extension (use the public cudasnap package)";
  init_errors(m);
  init_crc(m);
  init_staging(m);
  init_copy_plan(m);
  init_copy_engine(m);
  init_flusher(m);
  init_layout_check(m);
  init_signals(m);
  init_allocator_tracker(m);
#ifdef CUDASNAP_WITH_CUDA
  init_cuda_backend(m);
#endif
  init_test_hooks(m);
  init_build_info(m);
}
