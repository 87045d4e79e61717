#include "allocator_tracker.h"

#include "error.h"

namespace cudasnap {

AllocatorRegistry::~AllocatorRegistry() { queue_.stop_auto_drain(); }

uint64_t AllocatorRegistry::drain() {
  std::lock_guard<std::mutex> g(state_mu_);
  return drain_locked();
}

uint64_t AllocatorRegistry::drain_locked() {
  queue_.take(spare_);  // the queue keeps the spare's capacity
  uint64_t n = spare_.size();
  struct Done {  // even when apply() throws: waiters must not see a batch stuck in flight
    EventQueue& q;
    uint64_t n;
    ~Done() { q.finish_batch(n); }
  } done{queue_, n};
  for (const TraceEvent& ev : spare_)
    if (!devs_[ev.device].apply(ev)) ignored_.fetch_add(1, std::memory_order_relaxed);
  if (spare_.capacity() > (1u << 20) && n < (1u << 16)) {
    std::vector<TraceEvent>().swap(spare_);  // do not pin a burst's memory forever
  } else {
    spare_.clear();
  }
  return n;
}

const DeviceMemory* AllocatorRegistry::find(int device) const {
  auto it = devs_.find(device);
  return it == devs_.end() ? nullptr : &it->second;
}

uint64_t AllocatorRegistry::seed(int device, const std::vector<SeedSegment>& segments) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  uint64_t ignored = 0;
  uint64_t added = devs_[device].seed(segments, &ignored);
  ignored_.fetch_add(ignored, std::memory_order_relaxed);
  seeded_blocks_.fetch_add(added);
  return added;
}

bool AllocatorRegistry::seeded(int device) const {
  std::lock_guard<std::mutex> g(state_mu_);
  const DeviceMemory* d = find(device);
  return d != nullptr && d->seeded;
}

std::vector<LiveBlock> AllocatorRegistry::live_blocks(int device) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  std::vector<LiveBlock> out;
  if (const DeviceMemory* d = find(device)) {
    out.reserve(d->live.size());
    for (const auto& kv : d->live) out.push_back(kv.second);
  }
  return out;
}

std::vector<LiveBlock> AllocatorRegistry::pending_free(int device) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  std::vector<LiveBlock> out;
  if (const DeviceMemory* d = find(device))
    for (const auto& kv : d->pending) out.push_back(kv.second);
  return out;
}

std::vector<SegmentRange> AllocatorRegistry::segments(int device) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  std::vector<SegmentRange> out;
  if (const DeviceMemory* d = find(device))
    for (const auto& kv : d->segs) out.push_back(kv.second);
  return out;
}

std::vector<int> AllocatorRegistry::devices() {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  std::vector<int> out;
  for (const auto& kv : devs_) out.push_back(kv.first);
  return out;
}

uint64_t AllocatorRegistry::generation(int device) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  const DeviceMemory* d = find(device);
  return d == nullptr ? 0 : d->generation;
}

CoverageReport AllocatorRegistry::coverage(int device, const std::vector<Span>& spans,
                                           size_t top_n) {
  std::vector<Interval> merged = merge_spans(spans);
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  return cudasnap::coverage(find(device), merged, top_n);
}

std::vector<LocateResult> AllocatorRegistry::locate(int device, const std::vector<Span>& spans,
                                                    bool strict) {
  std::vector<LocateResult> out;
  {
    std::lock_guard<std::mutex> g(state_mu_);
    drain_locked();
    static const DeviceMemory kEmpty;
    const DeviceMemory* d = find(device);
    out = cudasnap::locate(d ? *d : kEmpty, device, spans);
  }
  for (const LocateResult& r : out) CUDASNAP_CHECK(r.ok || !strict, r.error);
  return out;
}

Coalesced AllocatorRegistry::coalesce(int device, const std::vector<Span>& spans,
                                      uint64_t merge_gap) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  static const DeviceMemory kEmpty;
  const DeviceMemory* d = find(device);
  return cudasnap::coalesce(d ? *d : kEmpty, spans, merge_gap);
}

RegistryStats AllocatorRegistry::stats() const {
  QueueCounts c = queue_.counts();
  RegistryStats s;
  s.recorded = c.recorded;
  s.applied = c.applied;
  s.dropped = c.dropped;
  s.queued = c.queued;
  s.ignored = ignored_.load();
  s.seeded_blocks = seeded_blocks_.load();
  return s;
}

void AllocatorRegistry::start_auto_drain(uint64_t threshold) {
  queue_.start_auto_drain(threshold, [this] { drain(); });
}

}  // namespace cudasnap
