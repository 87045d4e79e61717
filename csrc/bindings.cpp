// Python bindings for cudasnap._C. This file only binds: one init_<component>
// function per component; the logic lives in the component sources.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "copy_engine.h"
#include "copy_plan.h"
#include "crc32c.h"
#include "error.h"
#include "flusher.h"
#include "staging.h"
#include "allocator_tracker.h"
#ifdef CUDASNAP_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace py = pybind11;
using namespace cudasnap;

#ifndef CUDASNAP_VERSION
#define CUDASNAP_VERSION "0.0.0"
#endif
#ifndef CUDASNAP_CUDA_ARCHS
#define CUDASNAP_CUDA_ARCHS ""
#endif

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

py::dict slot_info_dict(const SlotInfo& s) {
  py::dict d;
  static const char* names[] = {"EMPTY", "WRITING", "COMPLETE"};
  d["index"] = s.index;
  d["state"] = s.state <= 2 ? names[s.state] : "UNKNOWN";
  d["valid"] = s.valid;
  d["problem"] = s.problem;
  d["seq"] = s.seq;
  d["step"] = s.step;
  d["data_bytes"] = s.data_bytes;
  d["meta_bytes"] = s.meta_bytes;
  d["num_chunks"] = s.num_chunks;
  d["complete_ns"] = s.complete_ns;
  d["writer_pid"] = s.writer_pid;
  return d;
}

py::dict flush_stats_dict(const FlushStats& s) {
  py::dict d;
  d["bytes"] = s.bytes;
  d["seconds"] = s.seconds;
  d["fsync_seconds"] = s.fsync_seconds;
  d["crc32c"] = s.crcs;
  return d;
}

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
}

void init_staging(py::module_& m) {
  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena")
      .def_static("create", &Arena::create, py::arg("path"), py::arg("num_slots"),
                  py::arg("data_capacity"), py::arg("meta_capacity"), py::arg("chunk_bytes"),
                  py::arg("job"), py::arg("prefault") = true,
                  py::call_guard<py::gil_scoped_release>())
      .def_static("open", &Arena::open, py::arg("path"), py::arg("writable") = true)
      .def_static("required_bytes", &Arena::required_bytes)
      .def_property_readonly("path", &Arena::path)
      .def_property_readonly("num_slots", &Arena::num_slots)
      .def_property_readonly("data_capacity", &Arena::data_capacity)
      .def_property_readonly("meta_capacity", &Arena::meta_capacity)
      .def_property_readonly("chunk_bytes", &Arena::chunk_bytes)
      .def_property_readonly("max_chunks", &Arena::max_chunks)
      .def_property_readonly("total_bytes", &Arena::total_bytes)
      .def_property_readonly("job", &Arena::job)
      .def_property_readonly("owner_pid", &Arena::owner_pid)
      .def_property_readonly("writable", &Arena::writable)
      .def_readonly("cuda_registered", &Arena::cuda_registered)
      .def("slot_info", [](const Arena& a, int s) { return slot_info_dict(a.slot_info(s)); })
      .def("newest_complete", &Arena::newest_complete)
      .def("pick_write_slot", &Arena::pick_write_slot)
      .def("begin_write", [](Arena& a, int s, int64_t step, const py::bytes& meta) {
        a.begin_write(s, step, std::string(meta));
      })
      .def("commit", &Arena::commit)
      .def("invalidate", &Arena::invalidate)
      .def("read_meta", [](const Arena& a, int s) { return py::bytes(a.read_meta(s)); })
      .def("read_table", &Arena::read_table)
      .def("table_ptr", [](const Arena& a, int s) { return reinterpret_cast<uint64_t>(a.table(s)); })
      .def("lease", &Arena::lease)
      .def("release", &Arena::release)
      .def("leases", &Arena::leases)
      .def("data_ptr", [](const Arena& a, int s) { return reinterpret_cast<uint64_t>(a.data(s)); })
      .def("data_view", [](const Arena& a, int s, uint64_t n) {
        CUDASNAP_CHECK_KIND(ErrorKind::Staging, n <= a.data_capacity(),
                            "view of " << n << " bytes exceeds slot capacity " << a.data_capacity());
        return py::memoryview::from_memory(a.data(s), static_cast<py::ssize_t>(n), !a.writable());
      })
      .def("unlink", &Arena::unlink_file);
}

void init_copy_plan(py::module_& m) {
  py::class_<CopyPlan, std::shared_ptr<CopyPlan>>(m, "CopyPlan")
      .def_readonly("total_bytes", &CopyPlan::total_bytes)
      .def_readonly("phase0_bytes", &CopyPlan::phase0_bytes)
      .def_readonly("chunk_bytes", &CopyPlan::chunk_bytes)
      .def_readonly("copied_bytes", &CopyPlan::copied_bytes)
      .def_readonly("tensor_offsets", &CopyPlan::tensor_offsets)
      .def_property_readonly("num_ranges", [](const CopyPlan& p) { return p.ranges.size(); })
      .def_property_readonly("num_chunks", &CopyPlan::num_chunks)
      .def_property_readonly("ranges", [](const CopyPlan& p) {
        py::list out;
        for (const auto& r : p.ranges) out.append(py::make_tuple(r.src, r.dst, r.nbytes, r.phase, r.host));
        return out;
      });
  m.def("build_plan",
        [](const std::vector<uint64_t>& ptrs, const std::vector<uint64_t>& nbytes,
           const std::vector<int>& phases, const std::vector<bool>& host, uint64_t chunk_bytes,
           uint64_t merge_gap, uint64_t align) {
          CUDASNAP_CHECK(ptrs.size() == nbytes.size() && ptrs.size() == phases.size() &&
                             ptrs.size() == host.size(),
                         "build_plan: ptrs, nbytes, phases and host differ in length");
          std::vector<TensorSpan> spans(ptrs.size());
          for (size_t i = 0; i < ptrs.size(); ++i) spans[i] = {ptrs[i], nbytes[i], phases[i], host[i]};
          return std::make_shared<CopyPlan>(build_plan(spans, chunk_bytes, merge_gap, align));
        },
        py::arg("ptrs"), py::arg("nbytes"), py::arg("phases"), py::arg("host"),
        py::arg("chunk_bytes"), py::arg("merge_gap") = 4096, py::arg("align") = 4096);
}

void init_copy_engine(py::module_& m) {
  py::class_<CopyJob, std::shared_ptr<CopyJob>>(m, "CopyJob")
      .def_property_readonly("slot", &CopyJob::slot)
      .def_property_readonly("step", &CopyJob::step)
      .def_property_readonly("bytes", &CopyJob::bytes)
      .def("done", &CopyJob::done, py::arg("phase") = 1)
      .def_property_readonly("failed", &CopyJob::failed)
      .def_property_readonly("error", &CopyJob::error)
      .def("wait", &CopyJob::wait, py::arg("phase") = 1, py::arg("timeout") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("seconds_to_complete", &CopyJob::seconds_to_complete);
  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "CopyEngine")
      .def_property_readonly("backend", &CopyEngine::backend)
      .def("submit",
           [](CopyEngine& e, const std::shared_ptr<Arena>& a, int slot,
              const std::shared_ptr<CopyPlan>& plan, int64_t step, const py::bytes& meta,
              uint64_t stream) {
             std::string m = meta;
             py::gil_scoped_release nogil;
             return e.submit(a, slot, plan, step, m, stream);
           },
           py::arg("arena"), py::arg("slot"), py::arg("plan"), py::arg("step"),
           py::arg("meta"), py::arg("stream") = 0)
      .def("fence", &CopyEngine::fence, py::arg("job"), py::arg("phase"), py::arg("stream") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &CopyEngine::shutdown, py::call_guard<py::gil_scoped_release>());
  py::class_<CpuCopyEngine, CopyEngine, std::shared_ptr<CpuCopyEngine>>(m, "CpuCopyEngine")
      .def(py::init<int>(), py::arg("threads"))
      .def_property_readonly("threads", &CpuCopyEngine::threads);
}

void init_flusher(py::module_& m) {
  m.def("write_slot_file",
        [](const Arena& a, int slot, const std::string& path, int threads, uint64_t io_bytes,
           bool durable) {
          FlushStats st;
          {
            py::gil_scoped_release nogil;
            st = write_slot_file(a, slot, path, threads, io_bytes, durable);
          }
          return flush_stats_dict(st);
        },
        py::arg("arena"), py::arg("slot"), py::arg("path"), py::arg("threads") = 4,
        py::arg("io_bytes") = 16 << 20, py::arg("durable") = true);
  m.def("write_buffer_file",
        [](uint64_t ptr, uint64_t nbytes, uint64_t chunk_bytes, const std::string& path,
           int threads, uint64_t io_bytes, bool durable) {
          FlushStats st;
          {
            py::gil_scoped_release nogil;
            st = write_file(reinterpret_cast<const uint8_t*>(ptr), nbytes, chunk_bytes, {}, path,
                            threads, io_bytes, durable);
          }
          return flush_stats_dict(st);
        },
        py::arg("ptr"), py::arg("nbytes"), py::arg("chunk_bytes"), py::arg("path"),
        py::arg("threads") = 4, py::arg("io_bytes") = 16 << 20, py::arg("durable") = true);
  m.def("read_file_verified",
        [](const std::string& path, uint64_t dst, uint64_t nbytes, uint64_t chunk_bytes,
           const std::vector<uint32_t>& crcs, int threads) {
          py::gil_scoped_release nogil;
          return read_file_verified(path, reinterpret_cast<uint8_t*>(dst), nbytes, chunk_bytes,
                                    crcs, threads);
        },
        py::arg("path"), py::arg("dst"), py::arg("nbytes"), py::arg("chunk_bytes"),
        py::arg("crcs"), py::arg("threads") = 4);
  m.def("verify_buffer",
        [](uint64_t ptr, uint64_t nbytes, uint64_t chunk_bytes, const std::vector<uint32_t>& crcs,
           int threads) {
          py::gil_scoped_release nogil;
          return verify_buffer(reinterpret_cast<const uint8_t*>(ptr), nbytes, chunk_bytes, crcs,
                               threads);
        },
        py::arg("ptr"), py::arg("nbytes"), py::arg("chunk_bytes"), py::arg("crcs"),
        py::arg("threads") = 4);
  m.def("fsync_dir", &fsync_dir, py::call_guard<py::gil_scoped_release>());
}

void init_allocator_tracker(py::module_& m) {
  (void)m;  // ALLOCATOR-TRACKER BINDINGS
}

#ifdef CUDASNAP_WITH_CUDA
void init_cuda_backend(py::module_& m) {
  m.def("cuda_device_count", &cuda_device_count);
  // CUDA-BACKEND BINDINGS
}
#endif

void init_build_info(py::module_& m) {
  py::dict info;
  info["version"] = CUDASNAP_VERSION;
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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cudasnap private extension (use the public cudasnap package)";
  init_errors(m);
  init_crc(m);
  init_staging(m);
  init_copy_plan(m);
  init_copy_engine(m);
  init_flusher(m);
  init_allocator_tracker(m);
#ifdef CUDASNAP_WITH_CUDA
  init_cuda_backend(m);
#endif
  init_build_info(m);
}
