// Python bindings for cudasnap._C. This file only binds: one init_<component>
// function per component; the logic lives in the component sources.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "copy_engine.h"
#include "copy_plan.h"
#include "crc32c.h"
#include "error.h"
#include "flusher.h"
#include "layout_check.h"
#include "signals.h"
#include "staging.h"
#include "allocator_tracker.h"
#ifdef CUDASNAP_WITH_CUDA
#include "cuda/copy_engine_cuda.h"
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
}

void init_staging(py::module_& m) {
  py::class_<CancelFlag, std::shared_ptr<CancelFlag>>(m, "CancelFlag")
      .def(py::init<>())
      .def("set", [](CancelFlag& c) { c.set.store(true); })
      .def_property_readonly("is_set", [](const CancelFlag& c) { return c.set.load(); });
  py::class_<MetaPrefix, std::shared_ptr<MetaPrefix>>(m, "MetaPrefix")
      .def(py::init([](const py::bytes& b) { return std::make_shared<MetaPrefix>(std::string(b)); }))
      .def_property_readonly("id", [](const MetaPrefix& p) { return p.id; })
      .def("__len__", [](const MetaPrefix& p) { return p.bytes.size(); });
  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena")
      .def_static("create",
                  [](const std::string& path, int num_slots, uint64_t data_capacity,
                     uint64_t meta_capacity, uint64_t chunk_bytes, const std::string& job,
                     bool prefault, const std::shared_ptr<CancelFlag>& cancel) {
                    return Arena::create(path, num_slots, data_capacity, meta_capacity,
                                         chunk_bytes, job, prefault, cancel.get());
                  },
                  py::arg("path"), py::arg("num_slots"), py::arg("data_capacity"),
                  py::arg("meta_capacity"), py::arg("chunk_bytes"), py::arg("job"),
                  py::arg("prefault") = true, py::arg("cancel") = nullptr,
                  py::call_guard<py::gil_scoped_release>())
      .def_static("open", &Arena::open, py::arg("path"), py::arg("writable") = true,
                  py::arg("prefault") = true, py::call_guard<py::gil_scoped_release>())
      .def(
          "prefault",
          [](Arena& a, const std::shared_ptr<CancelFlag>& cancel) { a.prefault(cancel.get()); },
          py::arg("cancel") = nullptr, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("huge_pages", &Arena::huge_pages)
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
      .def("claim_owner", &Arena::claim_owner)
      .def_property_readonly("writable", &Arena::writable)
      .def_property_readonly("shared", &Arena::shared)
      .def_readonly("cuda_registered", &Arena::cuda_registered)
      .def("slot_info", [](const Arena& a, int s) { return slot_info_dict(a.slot_info(s)); })
      .def("newest_complete", &Arena::newest_complete)
      .def("pick_write_slot", &Arena::pick_write_slot)
      .def("begin_write", [](Arena& a, int s, int64_t step, const py::bytes& meta) {
        a.begin_write(s, step, std::string(meta));
      })
      .def("commit", &Arena::commit)
      .def("meta_prefix_id", &Arena::meta_prefix_id, py::arg("slot"))
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
      .def_property_readonly("seconds_to_complete", &CopyJob::seconds_to_complete)
      .def("cancel", &CopyJob::cancel, py::arg("why"));
  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "CopyEngine")
      .def_property_readonly("backend", &CopyEngine::backend)
      .def("submit",
           [](CopyEngine& e, const std::shared_ptr<Arena>& a, int slot,
              const std::shared_ptr<CopyPlan>& plan, int64_t step, const py::bytes& meta,
              uint64_t stream, const std::shared_ptr<const MetaPrefix>& prefix) {
             // `meta` is the whole manifest, or with `prefix` its suffix (host state + step).
             SlotMeta m{prefix, meta};
             py::gil_scoped_release nogil;
             return e.submit(a, slot, plan, step, m, stream);
           },
           py::arg("arena"), py::arg("slot"), py::arg("plan"), py::arg("step"),
           py::arg("meta"), py::arg("stream") = 0, py::arg("prefix") = nullptr)
      .def("fence", &CopyEngine::fence, py::arg("job"), py::arg("phase"), py::arg("stream") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "shutdown",
          [](CopyEngine& e, double timeout) {
            return e.shutdown(timeout < 0 ? e.wait_timeout_s() : timeout);
          },
          py::arg("timeout") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def_property("wait_timeout_s", &CopyEngine::wait_timeout_s,
                    &CopyEngine::set_wait_timeout_s);
  py::class_<CpuCopyEngine, CopyEngine, std::shared_ptr<CpuCopyEngine>>(m, "CpuCopyEngine")
      .def(py::init<int, int>(), py::arg("threads"), py::arg("nice") = 10)
      .def_property_readonly("threads", &CpuCopyEngine::threads)
      .def_property_readonly("last_workers_used", &CpuCopyEngine::last_workers_used)
      .def_property_readonly("last_yield_chunks", &CpuCopyEngine::last_yield_chunks)
      .def("set_test_chunk_delay_us", &CpuCopyEngine::set_test_chunk_delay_us, py::arg("us"));
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
  m.def("flush_active", &flush_active, "flusher writes running now in this process");
  m.def("flushes_started", &flushes_started);
  m.def("_test_flush_active_add", &test_flush_active_add, py::arg("delta"),
        "TEST-ONLY: pretend a flush starts (+1) or ends (-1)");
}

void init_layout_check(py::module_& m) {
  py::class_<LayoutGuard>(m, "LayoutGuard")
      .def(py::init([](py::list tensors) { return new LayoutGuard(tensors.ptr()); }))
      .def("first_moved", &LayoutGuard::first_moved)
      .def("check_next", &LayoutGuard::check_next, py::arg("count"))
      .def("__len__", &LayoutGuard::size);
}

void init_signals(py::module_& m) {
  m.def("install_signal_pipe", &install_signal_pipe, py::arg("signals"));
  m.def("uninstall_signal_pipe", &uninstall_signal_pipe);
}

void init_allocator_tracker(py::module_& m) {
  // ALLOCATOR-TRACKER BINDINGS
  using Pair = std::pair<uint64_t, uint64_t>;
  auto to_spans = [](const std::vector<Pair>& v) {
    std::vector<Span> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = Span{v[i].first, v[i].second};
    return out;
  };
  auto block_tuple = [](const LiveBlock& b) {
    return py::make_tuple(b.addr, b.size, b.stream, py::make_tuple(b.pool.first, b.pool.second));
  };
  auto get = [](const py::dict& d, const char* k, py::object dflt) -> py::object {
    return d.contains(k) ? py::object(d[k]) : dflt;
  };
  m.def("trace_actions", [] {
    py::list out;
    for (int i = 0; i <= static_cast<int>(TraceAction::UNKNOWN); ++i)
      out.append(trace_action_name(static_cast<TraceAction>(i)));
    return out;
  });
  py::class_<AllocatorRegistry, std::shared_ptr<AllocatorRegistry>>(m, "AllocatorRegistry")
      .def(py::init<>())
      .def("record",
           [](AllocatorRegistry& r, const std::string& action, int device, uint64_t addr,
              uint64_t size, uint64_t stream, Pair pool) {
             TraceEvent ev;
             CUDASNAP_CHECK(parse_trace_action(action, &ev.action),
                            "unknown trace action '" << action << "'");
             ev.device = device;
             ev.addr = addr;
             ev.size = size;
             ev.stream = stream;
             ev.pool = pool;
             py::gil_scoped_release nogil;
             r.record(ev);
           },
           py::arg("action"), py::arg("device"), py::arg("addr"), py::arg("size"),
           py::arg("stream") = 0, py::arg("pool") = Pair{0, 0})
      .def("drain", &AllocatorRegistry::drain, py::call_guard<py::gil_scoped_release>())
      .def("seed",
           // segments as torch.cuda.memory_snapshot() returns them (dicts; extra keys ignored)
           [get](AllocatorRegistry& r, int device, const py::list& segments) {
             std::vector<SeedSegment> segs;
             for (const py::handle& h : segments) {
               py::dict sd = py::reinterpret_borrow<py::dict>(h);
               if (sd.contains("device") && sd["device"].cast<int>() != device) continue;
               SeedSegment ss;
               ss.addr = sd["address"].cast<uint64_t>();
               ss.size = sd["total_size"].cast<uint64_t>();
               ss.stream = get(sd, "stream", py::int_(0)).cast<uint64_t>();
               ss.pool = get(sd, "segment_pool_id", py::make_tuple(0, 0)).cast<Pair>();
               ss.expandable = get(sd, "is_expandable", py::bool_(false)).cast<bool>();
               uint64_t cursor = ss.addr;
               for (const py::handle& bh : get(sd, "blocks", py::list()).cast<py::list>()) {
                 py::dict bd = py::reinterpret_borrow<py::dict>(bh);
                 SeedBlock b;
                 b.addr = get(bd, "address", py::int_(cursor)).cast<uint64_t>();
                 uint64_t bsize = bd["size"].cast<uint64_t>();
                 uint64_t req = get(bd, "requested_size", py::int_(0)).cast<uint64_t>();
                 b.size = req ? req : bsize;
                 if (bd.contains("allocated"))
                   b.allocated = bd["allocated"].cast<bool>();
                 else
                   b.allocated = get(bd, "state", py::str("")).cast<std::string>() ==
                                 "active_allocated";
                 cursor = b.addr + bsize;
                 ss.blocks.push_back(b);
               }
               segs.push_back(std::move(ss));
             }
             py::gil_scoped_release nogil;
             return r.seed(device, segs);
           },
           py::arg("device"), py::arg("segments"))
      .def("seeded", &AllocatorRegistry::seeded)
      .def("live_blocks",
           [block_tuple](AllocatorRegistry& r, int device) {
             py::list out;
             for (const LiveBlock& b : r.live_blocks(device)) out.append(block_tuple(b));
             return out;
           })
      .def("pending_free",
           [block_tuple](AllocatorRegistry& r, int device) {
             py::list out;
             for (const LiveBlock& b : r.pending_free(device)) out.append(block_tuple(b));
             return out;
           })
      .def("segments",
           [](AllocatorRegistry& r, int device) {
             py::list out;
             for (const SegmentRange& s : r.segments(device))
               out.append(py::make_tuple(s.addr, s.size, s.expandable, s.stream,
                                         py::make_tuple(s.pool.first, s.pool.second)));
             return out;
           })
      .def("devices", &AllocatorRegistry::devices)
      .def("generation", &AllocatorRegistry::generation)
      .def("watched_generation", &AllocatorRegistry::watched_generation)
      .def("watch",
           [to_spans](AllocatorRegistry& r, int device, const std::vector<Pair>& spans) {
             r.watch(device, to_spans(spans));
           },
           py::arg("device"), py::arg("spans"))
      .def("coverage",
           [to_spans](AllocatorRegistry& r, int device, const std::vector<Pair>& spans,
                      size_t top_n) {
             CoverageReport c;
             {
               auto sp = to_spans(spans);
               py::gil_scoped_release nogil;
               c = r.coverage(device, sp, top_n);
             }
             py::dict d;
             d["live_bytes"] = c.live_bytes;
             d["covered_bytes"] = c.covered_bytes;
             d["uncovered_bytes"] = c.uncovered_bytes;
             d["live_blocks"] = c.live_blocks;
             d["uncovered_blocks"] = c.uncovered_blocks;
             d["span_bytes"] = c.span_bytes;
             d["outside_bytes"] = c.outside_bytes;
             d["pending_free_blocks"] = c.pending_free_blocks;
             py::list top;
             for (const LiveBlock& b : c.largest_uncovered) top.append(py::make_tuple(b.addr, b.size));
             d["largest_uncovered"] = top;
             return d;
           },
           py::arg("device"), py::arg("spans"), py::arg("top_n") = 8)
      .def("locate",
           [to_spans](AllocatorRegistry& r, int device, const std::vector<Pair>& spans,
                      bool strict) {
             std::vector<LocateResult> res = r.locate(device, to_spans(spans));
             py::list out;
             for (const LocateResult& x : res) {
               CUDASNAP_CHECK(x.ok || !strict, x.error);
               if (x.ok)
                 out.append(py::make_tuple(x.block.addr, x.block.size, x.segment.addr,
                                           x.segment.size));
               else
                 out.append(py::str(x.error));
             }
             return out;
           },
           py::arg("device"), py::arg("spans"), py::arg("strict") = false)
      .def("coalesce",
           [to_spans](AllocatorRegistry& r, int device, const std::vector<Pair>& spans,
                      uint64_t merge_gap) {
             Coalesced c = r.coalesce(device, to_spans(spans), merge_gap);
             py::list ranges, placement;
             for (const Span& s : c.ranges) ranges.append(py::make_tuple(s.addr, s.nbytes));
             for (const auto& p : c.placement) placement.append(py::make_tuple(p.first, p.second));
             return py::make_tuple(ranges, placement);
           },
           py::arg("device"), py::arg("spans"), py::arg("merge_gap") = 4096)
      .def("stats",
           [](const AllocatorRegistry& r) {
             RegistryStats s = r.stats();
             py::dict d;
             d["recorded"] = s.recorded;
             d["applied"] = s.applied;
             d["ignored"] = s.ignored;
             d["dropped"] = s.dropped;
             d["queued"] = s.queued;
             d["seeded_blocks"] = s.seeded_blocks;
             return d;
           })
      .def_property_readonly("healthy", &AllocatorRegistry::healthy)
      .def("start_auto_drain", &AllocatorRegistry::start_auto_drain, py::arg("threshold"))
      .def("stop_auto_drain", &AllocatorRegistry::stop_auto_drain,
           py::call_guard<py::gil_scoped_release>())
      .def("wait_auto_drained", &AllocatorRegistry::wait_auto_drained, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>());
}

#ifdef CUDASNAP_WITH_CUDA
void init_cuda_backend(py::module_& m) {
  m.def("cuda_device_count", &cuda_device_count);
  // CUDA-BACKEND BINDINGS
  py::class_<CudaCopyEngine, CopyEngine, std::shared_ptr<CudaCopyEngine>>(m, "CudaCopyEngine")
      .def(py::init<int, int, bool, uint64_t>(), py::arg("device"), py::arg("crc_threads") = 4,
           py::arg("gather_small") = false, py::arg("gather_max_bytes") = 64 * 1024)
      .def_property_readonly("device", &CudaCopyEngine::device)
      .def_property_readonly("crc_threads", &CudaCopyEngine::crc_threads)
      .def_property_readonly("gather_small", &CudaCopyEngine::gather_small)
      .def_property_readonly("gather_max_bytes", &CudaCopyEngine::gather_max_bytes)
      .def_property_readonly("busy", &CudaCopyEngine::busy)
      .def_property_readonly("hung", &CudaCopyEngine::hung)
      .def("set_test_copy_delay_us", &CudaCopyEngine::set_test_copy_delay_us, py::arg("us"))
      .def_property_readonly("copy_stream", &CudaCopyEngine::copy_stream)
      .def_property_readonly("last_memcpy_calls", &CudaCopyEngine::last_memcpy_calls)
      .def_property_readonly("last_gathered", &CudaCopyEngine::last_gathered);
  m.def("register_arena",
        [](Arena& a, int device) {
          RegisterResult r = register_arena(a, device);
          return py::make_tuple(r.ok, r.reason);
        },
        py::arg("arena"), py::arg("device") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("unregister_arena", &unregister_arena, py::arg("arena"),
        py::call_guard<py::gil_scoped_release>());
  m.def("create_private_pinned_arena", &create_private_pinned_arena, py::arg("num_slots"),
        py::arg("data_capacity"), py::arg("meta_capacity"), py::arg("chunk_bytes"),
        py::arg("job") = "", py::call_guard<py::gil_scoped_release>());
  m.def("attach_allocator_tracker", &attach_allocator_tracker, py::arg("auto_drain") = 16384,
        py::call_guard<py::gil_scoped_release>());
  m.def("attached_allocator_registry", &attached_allocator_registry);
}
#endif

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

}  // namespace

PYBIND11_MODULE(_C, m) {
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
  init_build_info(m);
}
