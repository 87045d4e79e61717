// Bindings of the staging arena, copy plans, copy engines and the flusher.
// Only binds (see bindings.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "../copy_engine.h"
#include "../copy_plan.h"
#include "../error.h"
#include "../file_restore.h"
#include "../flusher.h"
#include "../host_copy.h"
#include "../staging.h"
#include "bindings.h"
#include "restore_spans.h"

namespace py = pybind11;

namespace cudasnap::bindings {

namespace {

struct PlannedCopy {
  RestorePlan plan;
  py::list keep;  // owns the destination tensors the plan points into
  uint64_t lo = 0;
  uint64_t size = 0;
  bool done = false;
  uint64_t applied = 0;  // bytes run_file copied into destinations (also after a failure)
};

py::dict slot_info_dict(const SlotInfo& s) {
  return to_dict(s, field("index", &SlotInfo::index),
                 field("state", [](const SlotInfo& i) { return slot_state_name(i.state); }),
                 field("valid", &SlotInfo::valid), field("problem", &SlotInfo::problem),
                 field("seq", &SlotInfo::seq), field("step", &SlotInfo::step),
                 field("data_bytes", &SlotInfo::data_bytes),
                 field("meta_bytes", &SlotInfo::meta_bytes),
                 field("num_chunks", &SlotInfo::num_chunks),
                 field("complete_ns", &SlotInfo::complete_ns),
                 field("writer_pid", &SlotInfo::writer_pid));
}

py::dict flush_stats_dict(const FlushStats& s) {
  return to_dict(s, field("bytes", &FlushStats::bytes), field("seconds", &FlushStats::seconds),
                 field("fsync_seconds", &FlushStats::fsync_seconds),
                 field("crc32c", &FlushStats::crcs));
}

}  // namespace

py::dict scatter_stats_dict(const ScatterStats& st) {
  return to_dict(st, field("bytes", &ScatterStats::read_bytes),
                 field("applied", &ScatterStats::applied_bytes),
                 field("seconds", &ScatterStats::seconds), field("direct", &ScatterStats::direct),
                 field("ahead", &ScatterStats::ahead_bytes));
}

ScatterOptions scatter_options(int threads, uint64_t io_bytes, bool direct,
                               FileReadAhead* ahead) {
  ScatterOptions o;
  o.threads = threads;
  o.io_bytes = io_bytes;
  o.direct = direct;
  o.ahead = ahead;
  return o;
}

std::vector<HostSpan> host_spans(
    const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& spans) {
  std::vector<HostSpan> v;
  v.reserve(spans.size());
  for (const auto& [dst, off, n] : spans) v.push_back({dst, off, n});
  return v;
}


void init_staging(py::module_& m) {
  py::class_<CancelFlag, std::shared_ptr<CancelFlag>>(m, "CancelFlag")
      .def(py::init<>())
      .def("set", [](CancelFlag& c) { c.set.store(true); })
      .def_property_readonly("is_set", [](const CancelFlag& c) { return c.set.load(); })
      .def("pause", [](CancelFlag& c) { c.paused.fetch_add(1); },
           "holds the set-up at its next piece (nested pauses count)")
      .def(
          "resume",
          [](CancelFlag& c) {
            int cur = c.paused.load();
            while (cur > 0 && !c.paused.compare_exchange_weak(cur, cur - 1)) {
            }
          },
          "undoes one pause(); the set-up goes on when none is left")
      .def_property_readonly("paused", [](const CancelFlag& c) { return c.paused.load() > 0; });
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
        return py::memoryview::from_memory(a.data_span(s, n), static_cast<py::ssize_t>(n),
                                           !a.writable());
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
          return std::make_shared<CopyPlan>(
              build_plan(ptrs, nbytes, phases, host, chunk_bytes, merge_gap, align));
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
              const std::shared_ptr<CopyPlan>& plan, int64_t step, const py::object& meta,
              uint64_t stream, const std::shared_ptr<const MetaPrefix>& prefix) {
             // `meta` is the whole manifest, or with `prefix` its suffix (host state +
             // step): bytes, or a list/tuple of bytes written one after the other.
             // The text goes through one reused buffer: no allocation per boundary
             // once it is large enough (a >= 1 KB malloc right after an optimizer
             // step pays glibc's consolidation of every small block the step freed).
             static std::string buf;  // guarded by the GIL
             SlotMeta m{prefix, std::string()};
             m.suffix.swap(buf);
             m.suffix.clear();
             auto add = [&](PyObject* o) {
               if (!PyBytes_Check(o)) throw py::type_error("submit: meta parts must be bytes");
               m.suffix.append(PyBytes_AS_STRING(o), static_cast<size_t>(PyBytes_GET_SIZE(o)));
             };
             PyObject* mo = meta.ptr();
             if (PyList_Check(mo) || PyTuple_Check(mo)) {
               py::sequence seq = py::reinterpret_borrow<py::sequence>(meta);
               size_t total = 0;
               for (py::handle h : seq) total += PyBytes_Check(h.ptr()) ? PyBytes_GET_SIZE(h.ptr()) : 0;
               m.suffix.reserve(total);
               for (py::handle h : seq) add(h.ptr());
             } else {
               add(mo);
             }
             std::shared_ptr<CopyJob> job;
             {
               py::gil_scoped_release nogil;
               job = e.submit(a, slot, plan, step, m, stream);
             }
             buf.swap(m.suffix);  // keeps its capacity for the next boundary
             return job;
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

namespace {

// An arena slot or a buffer written to a file (the flusher), figures back as a dict.
void bind_file_writes(py::module_& m) {
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
}

// A file read back (whole or scattered), a buffer checked, spans copied in memory.
void bind_file_reads(py::module_& m) {
  m.def("read_file_verified",
        [](const std::string& path, uint64_t dst, uint64_t nbytes, uint64_t chunk_bytes,
           const std::vector<uint32_t>& crcs, int threads) {
          py::gil_scoped_release nogil;
          return read_file_verified(path, reinterpret_cast<uint8_t*>(dst), nbytes, chunk_bytes,
                                    crcs, threads);
        },
        py::arg("path"), py::arg("dst"), py::arg("nbytes"), py::arg("chunk_bytes"),
        py::arg("crcs"), py::arg("threads") = 4);
  m.def("read_file_scatter",
        [](int fd, const std::string& name, uint64_t nbytes, uint64_t chunk_bytes,
           const std::vector<uint32_t>& crcs,
           const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& spans, int threads,
           uint64_t io_bytes, bool direct, FileReadAhead* ahead) {
          std::vector<HostSpan> v = host_spans(spans);
          ScatterStats st;
          {
            py::gil_scoped_release nogil;
            read_verify_scatter(fd, name, nbytes, chunk_bytes, crcs, v,
                                scatter_options(threads, io_bytes, direct, ahead), &st);
          }
          return scatter_stats_dict(st);
        },
        py::arg("fd"), py::arg("name"), py::arg("nbytes"), py::arg("chunk_bytes"),
        py::arg("crcs"), py::arg("spans"), py::arg("threads") = 2, py::arg("io_bytes") = 0,
        py::arg("direct") = false, py::arg("ahead") = py::none(),
        "reads the open file `fd` chunk by chunk, checks each chunk's CRC32C, then copies "
        "its bytes named by the (dst_ptr, file_offset, nbytes) spans; CorruptSnapshot on a "
        "bad chunk (none of its bytes copied). `ahead`: a FileReadAhead of this file");
  m.def("verify_buffer",
        [](uint64_t ptr, uint64_t nbytes, uint64_t chunk_bytes, const std::vector<uint32_t>& crcs,
           int threads) {
          py::gil_scoped_release nogil;
          return verify_buffer(reinterpret_cast<const uint8_t*>(ptr), nbytes, chunk_bytes, crcs,
                               threads);
        },
        py::arg("ptr"), py::arg("nbytes"), py::arg("chunk_bytes"), py::arg("crcs"),
        py::arg("threads") = 4);
  m.def("copy_spans",
        [](uint64_t src, uint64_t src_nbytes,
           const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& spans, int threads,
           uint64_t piece_bytes) {
          std::vector<HostSpan> v = host_spans(spans);
          py::gil_scoped_release nogil;
          return copy_spans(reinterpret_cast<const uint8_t*>(src), src_nbytes, v, threads,
                            piece_bytes);
        },
        py::arg("src"), py::arg("src_nbytes"), py::arg("spans"), py::arg("threads") = 4,
        py::arg("piece_bytes") = kHostCopyPiece,
        "copies (dst_ptr, src_offset, nbytes) spans out of [src, src + src_nbytes) on "
        "`threads` threads; every span is checked first");
}

// RestorePlan: restore's planned byte copies, run from memory or from a file.
void bind_restore_plan(py::module_& m) {
  py::class_<PlannedCopy>(m, "RestorePlan",
                          "restore's byte copies, planned by plan_pairs; run() copies them")
      .def_property_readonly("slow", [](const PlannedCopy& p) { return p.plan.slow; },
                             "indices of the pairs left to torch copy_")
      .def_property_readonly("count", [](const PlannedCopy& p) { return p.plan.spans.size(); })
      .def("run",
           [](PlannedCopy& p, int threads) {
             CUDASNAP_CHECK(!p.done, "RestorePlan.run: already run");
             p.done = true;
             uint64_t moved = 0;
             if (!p.plan.spans.empty()) {
               py::gil_scoped_release nogil;  // p.keep holds the destination tensors
               moved = copy_spans(reinterpret_cast<const uint8_t*>(p.lo), p.size, p.plan.spans,
                                  threads);
             }
             bump_versions(p.plan);
             return moved;
           },
           py::arg("threads") = 4,
           "copies the planned spans (every one checked first), marks their destinations "
           "modified in place; returns the bytes copied")
      .def_property_readonly("applied", [](const PlannedCopy& p) { return p.applied; },
                             "bytes run_file copied into the destinations, also when it "
                             "raised (0: they are untouched)")
      .def("run_file",
           [](PlannedCopy& p, int fd, const std::string& name, uint64_t nbytes,
              uint64_t chunk_bytes, const std::vector<uint32_t>& crcs,
              const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& extra, int threads,
              uint64_t io_bytes, bool direct, FileReadAhead* ahead) {
             CUDASNAP_CHECK(!p.done, "RestorePlan.run_file: already run");
             CUDASNAP_CHECK(p.lo != 0 && p.size == nbytes,
                            "RestorePlan.run_file: planned for a buffer of "
                                << p.size << " bytes, the file has " << nbytes);
             p.done = true;
             std::vector<HostSpan> spans = p.plan.spans;  // offsets in the buffer = in the file
             spans.reserve(spans.size() + extra.size());
             for (const auto& [dst, off, n] : extra) spans.push_back({dst, off, n});
             ScatterStats st;
             try {
               py::gil_scoped_release nogil;  // p.keep holds the destination tensors
               read_verify_scatter(fd, name, nbytes, chunk_bytes, crcs, spans,
                                   scatter_options(threads, io_bytes, direct, ahead), &st);
             } catch (...) {
               p.applied = st.applied_bytes;
               if (p.applied > 0) bump_versions(p.plan);  // changed in place, if only partly
               throw;
             }
             p.applied = st.applied_bytes;
             bump_versions(p.plan);
             return scatter_stats_dict(st);
           },
           py::arg("fd"), py::arg("name"), py::arg("nbytes"), py::arg("chunk_bytes"),
           py::arg("crcs"), py::arg("extra"), py::arg("threads") = 2, py::arg("io_bytes") = 0,
           py::arg("direct") = false, py::arg("ahead") = py::none(),
           "the planned byte copies (plan_pairs with lo, size = a buffer standing for the "
           "file), read from the open file `fd` chunk by chunk, each chunk CRC32C-checked "
           "before any byte of it is copied; `extra`: more (dst_ptr, file_offset, nbytes) "
           "spans (the bytes torch's copy_ will read from that buffer); marks the planned "
           "destinations modified in place. `ahead`: a FileReadAhead of this file (finished "
           "here; its bytes are checked like the ones read)");
}

void bind_file_read_ahead(py::module_& m) {
  py::class_<FileReadAhead>(m, "FileReadAhead",
                            "the head of a file read on a thread of its own (best effort: "
                            "`error` says why it stopped short); RestorePlan.run_file takes it")
      .def(py::init<int, uint64_t, uint64_t>(), py::arg("fd"), py::arg("limit"),
           py::arg("piece") = 4ull << 20,
           "dups `fd` and starts reading [0, min(size, limit)) of it")
      .def("finish",
           [](FileReadAhead& a) {
             py::gil_scoped_release nogil;
             return a.finish();
           },
           "stops the reader after its current read, waits for it; returns the bytes held")
      .def("release",
           [](FileReadAhead& a) {
             py::gil_scoped_release nogil;
             a.release();
           },
           "finish(), then frees the buffer (held is 0 after it)")
      .def_property_readonly("held", &FileReadAhead::held)
      .def_property_readonly("target", &FileReadAhead::target)
      .def_property_readonly("error", &FileReadAhead::error);
}

// After RestorePlan is bound, so that its signature names the class.
void bind_plan_pairs(py::module_& m) {
  m.def("plan_pairs",
        [](py::list dsts, py::list srcs, py::dict dtypes, py::tuple plain_types,
           py::object src_type, uint64_t lo, uint64_t size) {
          PlannedCopy p;
          p.plan = plan_restore(dsts.ptr(), srcs.ptr(), dtypes.ptr(), plain_types.ptr(),
                                src_type.ptr(), lo, size);
          p.keep = py::list(dsts);  // a private copy: the caller's list may change
          p.lo = lo;
          p.size = size;
          return p;
        },
        py::arg("dsts"), py::arg("srcs"), py::arg("dtypes"), py::arg("plain_types"),
        py::arg("src_type"), py::arg("lo"), py::arg("size"),
        "restore's copy-back plan: which (dst, src) pairs are byte copies (src a manifest "
        "entry or a tensor inside [lo, lo + size)), without a Python call per pair");
}

// The flusher's process-wide counters, and fsync of a directory.
void bind_flush_counters(py::module_& m) {
  m.def("fsync_dir", &fsync_dir, py::call_guard<py::gil_scoped_release>());
  m.def("flush_active", &flush_active, "flusher writes running now in this process");
  m.def("flushes_started", &flushes_started);
  m.def("io_bytes", [] {
    IoBytes b = io_bytes();
    return py::make_tuple(b.written, b.read);
  }, "(bytes written, bytes read) by the flusher in this process since load");
  m.def("_test_flush_active_add", &test_flush_active_add, py::arg("delta"),
        "TEST-ONLY: pretend a flush starts (+1) or ends (-1)");
}

}  // namespace

// In this order: a function's signature names the classes bound before it.
void init_flusher(py::module_& m) {
  bind_file_writes(m);
  bind_file_reads(m);
  bind_restore_plan(m);
  bind_file_read_ahead(m);
  bind_plan_pairs(m);
  bind_flush_counters(m);
}

}  // namespace cudasnap::bindings
