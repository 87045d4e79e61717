// Feeds the AllocatorRegistry from the CUDA caching allocator.
//
// The tracker callback runs under the allocator's per-device mutex, on any
// thread, possibly holding the GIL: it only converts the entry and calls
// AllocatorRegistry::record() (noexcept; takes the registry's queue lock only).
//
// Supports torch 2.6 to 2.15 (tools/compile_check.py checks the headers of
// several releases); the differences are gated on torch's version macros.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/version.h>

#include <mutex>

#include "../error.h"
#include "cuda_backend.h"

namespace cudasnap {

namespace {

#define CUDASNAP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace CCA = c10::cuda::CUDACachingAllocator;
// TraceEntry moved from c10::cuda::CUDACachingAllocator to
// c10::CachingDeviceAllocator in torch 2.11; CCA declares or re-exports it in every release.
using TraceEntry = CCA::TraceEntry;

TraceAction convert(TraceEntry::Action a) noexcept {
  switch (a) {
    case TraceEntry::ALLOC: return TraceAction::ALLOC;
    case TraceEntry::FREE_REQUESTED: return TraceAction::FREE_REQUESTED;
    case TraceEntry::FREE_COMPLETED: return TraceAction::FREE_COMPLETED;
    case TraceEntry::SEGMENT_ALLOC: return TraceAction::SEGMENT_ALLOC;
    case TraceEntry::SEGMENT_FREE: return TraceAction::SEGMENT_FREE;
    case TraceEntry::SEGMENT_MAP: return TraceAction::SEGMENT_MAP;
    case TraceEntry::SEGMENT_UNMAP: return TraceAction::SEGMENT_UNMAP;
    case TraceEntry::SNAPSHOT: return TraceAction::SNAPSHOT;
    case TraceEntry::OOM: return TraceAction::OOM;
#if CUDASNAP_TORCH_AT_LEAST(2, 14)
    case TraceEntry::ANNOTATE: return TraceAction::ANNOTATE;  // added in torch 2.14
#endif
    default: return TraceAction::UNKNOWN;  // an action a newer torch added
  }
}

std::mutex g_attach_mu;
std::shared_ptr<AllocatorRegistry>* g_registry = nullptr;  // leaked on purpose

}  // namespace

std::shared_ptr<AllocatorRegistry> attached_allocator_registry() {
  std::lock_guard<std::mutex> g(g_attach_mu);
  return g_registry ? *g_registry : nullptr;
}

std::shared_ptr<AllocatorRegistry> attach_allocator_tracker(uint64_t auto_drain) {
  std::lock_guard<std::mutex> g(g_attach_mu);
  if (g_registry) return *g_registry;
  const int ndev = static_cast<int>(c10::cuda::device_count());
  CUDASNAP_CHECK_KIND(ErrorKind::Cuda, ndev > 0,
                      "attach_allocator_tracker: no CUDA device is visible "
                      "(c10::cuda::device_count() == 0)");
  CCA::CUDAAllocator* alloc = CCA::get();
  CUDASNAP_CHECK(alloc != nullptr, "attach_allocator_tracker: no CUDA allocator is installed");
  CUDASNAP_CHECK(alloc->initialized(),
                 "attach_allocator_tracker: the CUDA caching allocator is not initialised yet; "
                 "CUDA lazy init must run first (call torch.cuda.init() or create a CUDA tensor)");
  const std::string name = alloc->name();
  CUDASNAP_CHECK(name == "native",
                 "attach_allocator_tracker: the CUDA allocator backend is '"
                     << name << "', trace trackers need the native caching allocator "
                                "(PYTORCH_CUDA_ALLOC_CONF backend:native)");

  auto* reg = new AllocatorRegistry();  // never freed: the allocator keeps calling it
  // Attach first, then enumerate: whatever happens in between is in the queue.
  alloc->attachAllocatorTraceTracker([reg](const TraceEntry& te) {
    TraceEvent ev;
    ev.action = convert(te.action_);
    ev.device = static_cast<int>(te.device_);
    ev.addr = static_cast<uint64_t>(te.addr_);
    ev.size = static_cast<uint64_t>(te.size_);
    ev.stream = reinterpret_cast<uint64_t>(te.stream_);
#if CUDASNAP_TORCH_AT_LEAST(2, 8)
    ev.pool = PoolId{static_cast<uint64_t>(te.mempool_.first),
                     static_cast<uint64_t>(te.mempool_.second)};
#else  // TraceEntry::mempool_ was added in torch 2.8: events carry no pool id
    ev.pool = PoolId{0, 0};
#endif
    reg->record(ev);
  });

  // snapshot() takes the allocator's locks: none of ours is held here (the
  // registry's locks are only taken inside record()/seed()).
#if CUDASNAP_TORCH_AT_LEAST(2, 11)
  CCA::SnapshotInfo snap = alloc->snapshot({0, 0}, /*include_traces=*/false);
#else  // include_traces arrived in torch 2.11 (2.8-2.10: snapshot(mempool_id), 2.6-2.7: snapshot())
  CCA::SnapshotInfo snap = alloc->snapshot();
#endif
  std::vector<std::vector<SeedSegment>> per_dev(static_cast<size_t>(ndev));
  for (const auto& si : snap.segments) {
    int d = static_cast<int>(si.device);
    if (d < 0 || d >= ndev) continue;
    SeedSegment ss;
    ss.addr = static_cast<uint64_t>(si.address);
    ss.size = static_cast<uint64_t>(si.total_size);
    ss.stream = reinterpret_cast<uint64_t>(si.stream);
    ss.pool = PoolId{static_cast<uint64_t>(si.owner_private_pool_id.first),
                     static_cast<uint64_t>(si.owner_private_pool_id.second)};
    ss.expandable = si.is_expandable;
    ss.next_block_addr = ss.addr;
    for (const auto& bi : si.blocks)  // contiguous from the segment start
      ss.add_block(-1, static_cast<uint64_t>(bi.size), static_cast<uint64_t>(bi.requested_size),
                   bi.allocated);
    per_dev[static_cast<size_t>(d)].push_back(std::move(ss));
  }
  for (int d = 0; d < ndev; ++d) reg->seed(d, per_dev[static_cast<size_t>(d)]);
  if (auto_drain > 0) reg->start_auto_drain(auto_drain);
  g_registry = new std::shared_ptr<AllocatorRegistry>(reg, [](AllocatorRegistry*) {});
  return *g_registry;
}

}  // namespace cudasnap
