// Bindings of the allocator registry and the CUDA backend. Only binds (see
// bindings.h).
#include <pybind11/pybind11.h>
#include <exception>
#include <pybind11/stl.h>

#include "../allocator_tracker.h"
#include "../error.h"
#include "bindings.h"
#ifdef CUDASNAP_WITH_CUDA
#include "../cuda/copy_engine_cuda.h"
#include "../cuda/cuda_backend.h"
#include "../cuda/device_sink.h"
#endif

namespace py = pybind11;

namespace cudasnap::bindings {

namespace {

using Pair = std::pair<uint64_t, uint64_t>;
using Registry = py::class_<AllocatorRegistry, std::shared_ptr<AllocatorRegistry>>;

py::object get(const py::dict& d, const char* k, py::object dflt) {
  return d.contains(k) ? py::object(d[k]) : dflt;
}

// One segment dict of torch.cuda.memory_snapshot() (extra keys ignored).
SeedSegment seed_segment(const py::dict& sd) {
  SeedSegment ss;
  ss.addr = sd["address"].cast<uint64_t>();
  ss.size = sd["total_size"].cast<uint64_t>();
  ss.stream = get(sd, "stream", py::int_(0)).cast<uint64_t>();
  ss.pool = get(sd, "segment_pool_id", py::make_tuple(0, 0)).cast<Pair>();
  ss.expandable = get(sd, "is_expandable", py::bool_(false)).cast<bool>();
  ss.next_block_addr = ss.addr;
  for (const py::handle& bh : get(sd, "blocks", py::list()).cast<py::list>()) {
    py::dict bd = py::reinterpret_borrow<py::dict>(bh);
    bool allocated = bd.contains("allocated")
                         ? bd["allocated"].cast<bool>()
                         : get(bd, "state", py::str("")).cast<std::string>() == "active_allocated";
    ss.add_block(bd.contains("address") ? bd["address"].cast<int64_t>() : -1,
                 bd["size"].cast<uint64_t>(), get(bd, "requested_size", py::int_(0)).cast<uint64_t>(),
                 allocated);
  }
  return ss;
}

std::vector<Span> to_spans(const std::vector<Pair>& v) {
  std::vector<Span> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Span{v[i].first, v[i].second};
  return out;
}

py::tuple block_tuple(const LiveBlock& b) {
  return py::make_tuple(b.addr, b.size, b.stream, py::make_tuple(b.pool.first, b.pool.second));
}

py::dict coverage_dict(const CoverageReport& c) {
  return to_dict(c, field("live_bytes", &CoverageReport::live_bytes),
                 field("covered_bytes", &CoverageReport::covered_bytes),
                 field("uncovered_bytes", &CoverageReport::uncovered_bytes),
                 field("live_blocks", &CoverageReport::live_blocks),
                 field("uncovered_blocks", &CoverageReport::uncovered_blocks),
                 field("span_bytes", &CoverageReport::span_bytes),
                 field("outside_bytes", &CoverageReport::outside_bytes),
                 field("pending_free_blocks", &CoverageReport::pending_free_blocks),
                 field("largest_uncovered", [](const CoverageReport& r) {
                   py::list top;
                   for (const LiveBlock& b : r.largest_uncovered)
                     top.append(py::make_tuple(b.addr, b.size));
                   return top;
                 }));
}

py::dict registry_stats_dict(const RegistryStats& s) {
  return to_dict(s, field("recorded", &RegistryStats::recorded),
                 field("applied", &RegistryStats::applied),
                 field("ignored", &RegistryStats::ignored),
                 field("dropped", &RegistryStats::dropped), field("queued", &RegistryStats::queued),
                 field("seeded_blocks", &RegistryStats::seeded_blocks));
}

// Events in: one recorded, the queue drained, a seed from torch.cuda.memory_snapshot().
void bind_registry_events(Registry& reg) {
  reg.def("record",
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
           [](AllocatorRegistry& r, int device, const py::list& segments) {
             std::vector<SeedSegment> segs;
             for (const py::handle& h : segments) {
               py::dict sd = py::reinterpret_borrow<py::dict>(h);
               if (sd.contains("device") && sd["device"].cast<int>() != device) continue;
               segs.push_back(seed_segment(sd));
             }
             py::gil_scoped_release nogil;
             return r.seed(device, segs);
           },
           py::arg("device"), py::arg("segments"))
      .def("seeded", &AllocatorRegistry::seeded);
}

// What the registry holds: live blocks, pending frees, segments, devices.
void bind_registry_contents(Registry& reg) {
  reg.def("live_blocks",
          [](AllocatorRegistry& r, int device) {
            py::list out;
            for (const LiveBlock& b : r.live_blocks(device)) out.append(block_tuple(b));
            return out;
          })
      .def("pending_free",
           [](AllocatorRegistry& r, int device) {
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
      .def("generation", &AllocatorRegistry::generation);
}

// Spans against the live blocks: how much they cover, where each lies, merged ranges.
void bind_registry_span_queries(Registry& reg) {
  reg.def("coverage",
          [](AllocatorRegistry& r, int device, const std::vector<Pair>& spans, size_t top_n) {
            CoverageReport c;
            {
              auto sp = to_spans(spans);
              py::gil_scoped_release nogil;
              c = r.coverage(device, sp, top_n);
            }
            return coverage_dict(c);
          },
          py::arg("device"), py::arg("spans"), py::arg("top_n") = 8)
      .def("locate",
           [](AllocatorRegistry& r, int device, const std::vector<Pair>& spans, bool strict) {
             std::vector<LocateResult> res = r.locate(device, to_spans(spans), strict);
             py::list out;
             for (const LocateResult& x : res) {
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
           [](AllocatorRegistry& r, int device, const std::vector<Pair>& spans,
              uint64_t merge_gap) {
             Coalesced c = r.coalesce(device, to_spans(spans), merge_gap);
             py::list ranges, placement;
             for (const Span& s : c.ranges) ranges.append(py::make_tuple(s.addr, s.nbytes));
             for (const auto& p : c.placement) placement.append(py::make_tuple(p.first, p.second));
             return py::make_tuple(ranges, placement);
           },
           py::arg("device"), py::arg("spans"), py::arg("merge_gap") = 4096);
}

// Its health: the counters, and the auto-drain thread.
void bind_registry_health(Registry& reg) {
  reg.def("stats", [](const AllocatorRegistry& r) { return registry_stats_dict(r.stats()); })
      .def_property_readonly("healthy", &AllocatorRegistry::healthy)
      .def("start_auto_drain", &AllocatorRegistry::start_auto_drain, py::arg("threshold"))
      .def("stop_auto_drain", &AllocatorRegistry::stop_auto_drain,
           py::call_guard<py::gil_scoped_release>())
      .def("wait_auto_drained", &AllocatorRegistry::wait_auto_drained, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace

void init_allocator_tracker(py::module_& m) {
  m.def("trace_actions", [] {
    py::list out;
    for (int i = 0; i <= static_cast<int>(TraceAction::UNKNOWN); ++i)
      out.append(trace_action_name(static_cast<TraceAction>(i)));
    return out;
  });
  Registry reg(m, "AllocatorRegistry");
  reg.def(py::init<>());
  bind_registry_events(reg);
  bind_registry_contents(reg);
  bind_registry_span_queries(reg);
  bind_registry_health(reg);
}

#ifdef CUDASNAP_WITH_CUDA
void init_cuda_backend(py::module_& m) {
  m.def("cuda_device_count", &cuda_device_count);
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
      .def_property_readonly("last_gathered", &CudaCopyEngine::last_gathered)
      .def_property_readonly("last_staged", &CudaCopyEngine::last_staged)
      .def_property_readonly("batched", &CudaCopyEngine::batched)
      .def_property_readonly("batch_refusal", &CudaCopyEngine::batch_refusal)
      // Waits (bounded) for the running copy: no GIL held meanwhile.
      .def("set_device_staging", &CudaCopyEngine::set_device_staging, py::arg("ptr"),
           py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("device_staging_bytes", &CudaCopyEngine::device_staging_bytes);
  // The GIL is released around the CUDA calls only: the (ok, reason) tuple is
  // made after it is taken back (a Python object made without it crashes).
  m.def(
      "read_file_to_device",
      [](int fd, const std::string& name, uint64_t nbytes, uint64_t chunk_bytes,
         const std::vector<uint32_t>& crcs,
         const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& host,
         const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& device_spans, int device,
         int threads, uint64_t io_bytes, bool direct, FileReadAhead* ahead, double wait_s,
         py::dict progress) {
        const std::vector<HostSpan> h = host_spans(host), d = host_spans(device_spans);
        ScatterStats st;
        uint64_t copies = 0, pinned = 0;
        std::exception_ptr err;
        {
          py::gil_scoped_release nogil;  // the caller holds the destination tensors
          try {
            CudaUnitSink sink(device, std::max(threads, 1), wait_s);  // drained when it goes
            ScatterOptions o = scatter_options(threads, io_bytes, direct, ahead);
            o.device_spans = &d;
            o.sink = &sink;
            read_verify_scatter(fd, name, nbytes, chunk_bytes, crcs, h, o, &st);
            copies = sink.copies();
            pinned = sink.pinned_bytes();
          } catch (...) {
            err = std::current_exception();
          }
        }
        progress["applied"] = st.applied_bytes;  // also after a failure (GIL held again)
        if (err) std::rethrow_exception(err);
        py::dict out = scatter_stats_dict(st);
        out["device_copies"] = copies;
        out["pinned_bytes"] = pinned;
        return out;
      },
      py::arg("fd"), py::arg("name"), py::arg("nbytes"), py::arg("chunk_bytes"), py::arg("crcs"),
      py::arg("host"), py::arg("device_spans"), py::arg("device"), py::arg("threads") = 2,
      py::arg("io_bytes") = 0, py::arg("direct") = false, py::arg("ahead") = py::none(),
      py::arg("wait_s") = 120.0, py::arg("progress") = py::dict(),
      "reads the open snapshot file `fd` chunk by chunk into page-locked buffers, checks "
      "each chunk's CRC32C, then copies its bytes: (dst, file_offset, nbytes) `host` spans by "
      "memcpy, `device_spans` (device addresses on cuda:`device`) by cudaMemcpyAsync, the "
      "next read overlapping the copies; returns when every copy is done. `progress`"
      "['applied']: the bytes copied, also when it raised (0: destinations untouched)");
  m.def("register_arena",
        [](Arena& a, int device) {
          RegisterResult r;
          {
            py::gil_scoped_release nogil;
            r = register_arena(a, device);
          }
          return py::make_tuple(r.ok, r.reason);
        },
        py::arg("arena"), py::arg("device") = -1);
  m.def("unregister_arena", &unregister_arena, py::arg("arena"),
        py::call_guard<py::gil_scoped_release>());
  m.def("create_private_pinned_arena", &create_private_pinned_arena, py::arg("num_slots"),
        py::arg("data_capacity"), py::arg("meta_capacity"), py::arg("chunk_bytes"),
        py::arg("job") = "", py::arg("device") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("attach_allocator_tracker", &attach_allocator_tracker, py::arg("auto_drain") = 16384,
        py::call_guard<py::gil_scoped_release>());
  m.def("attached_allocator_registry", &attached_allocator_registry);
}
#endif

}  // namespace cudasnap::bindings
