#include "allocator_tracker.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <iomanip>
#include <limits>
#include <sstream>
#include <tuple>

#include "error.h"

namespace cudasnap {

namespace {

using Interval = std::pair<uint64_t, uint64_t>;  // [lo, hi)

constexpr const char* kActionNames[] = {
    "alloc",         "free_requested", "free_completed", "segment_alloc",
    "segment_free",  "segment_map",    "segment_unmap",  "snapshot",
    "oom",           "annotate",       "unknown",
};

// Sorted, merged, non-empty intervals of `spans`.
std::vector<Interval> merge_spans(const std::vector<Span>& spans) {
  std::vector<Interval> v;
  v.reserve(spans.size());
  for (const Span& s : spans)
    if (s.nbytes > 0) v.emplace_back(s.addr, s.addr + s.nbytes);
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const Interval& iv : v) {
    if (!out.empty() && iv.first <= out.back().second)
      out.back().second = std::max(out.back().second, iv.second);
    else
      out.push_back(iv);
  }
  return out;
}

// [lo, hi) minus the union of `cuts` (any order); pieces sorted.
std::vector<Interval> subtract(uint64_t lo, uint64_t hi, std::vector<Interval> cuts) {
  std::sort(cuts.begin(), cuts.end());
  std::vector<Interval> out;
  uint64_t cur = lo;
  for (const Interval& c : cuts) {
    if (c.second <= cur || c.first >= hi) continue;
    if (c.first > cur) out.emplace_back(cur, c.first);
    cur = std::max(cur, c.second);
    if (cur >= hi) break;
  }
  if (cur < hi) out.emplace_back(cur, hi);
  return out;
}

std::string hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

std::string span_name(size_t i, const Span& s) {
  std::ostringstream os;
  os << "span " << i << " [" << hex(s.addr) << ", +" << s.nbytes << ")";
  return os.str();
}

}  // namespace

const char* trace_action_name(TraceAction a) noexcept {
  int i = static_cast<int>(a);
  if (i < 0 || i > static_cast<int>(TraceAction::UNKNOWN)) i = static_cast<int>(TraceAction::UNKNOWN);
  return kActionNames[i];
}

bool parse_trace_action(const std::string& name, TraceAction* out) noexcept {
  std::string n;
  n.reserve(name.size());
  for (char c : name) n.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  for (int i = 0; i <= static_cast<int>(TraceAction::UNKNOWN); ++i) {
    if (n == kActionNames[i]) {
      *out = static_cast<TraceAction>(i);
      return true;
    }
  }
  return false;
}

AllocatorRegistry::~AllocatorRegistry() { stop_auto_drain(); }

// ------------------------------------------------------------------ record

bool AllocatorRegistry::overlaps(const std::vector<Interval>& merged, uint64_t lo, uint64_t hi) {
  if (merged.empty() || hi <= lo) return false;
  // First interval ending after lo (ends are sorted too: intervals are disjoint).
  auto it = std::upper_bound(merged.begin(), merged.end(), lo,
                             [](uint64_t v, const Interval& iv) { return v < iv.second; });
  return it != merged.end() && it->first < hi;
}

void AllocatorRegistry::record(const TraceEvent& ev) noexcept {
  try {
    std::lock_guard<std::mutex> g(queue_mu_);
    switch (ev.action) {
      case TraceAction::FREE_REQUESTED:
      case TraceAction::FREE_COMPLETED:
      case TraceAction::SEGMENT_FREE:
      case TraceAction::SEGMENT_UNMAP: {
        auto it = watches_.find(ev.device);
        if (it != watches_.end() &&
            overlaps(it->second.spans, ev.addr, ev.addr + std::max<uint64_t>(ev.size, 1)))
          ++it->second.generation;
        break;
      }
      default:
        break;
    }
    queue_.push_back(ev);
    recorded_.fetch_add(1, std::memory_order_relaxed);
    if (auto_threshold_ && queue_.size() == auto_threshold_) drain_cv_.notify_one();
  } catch (...) {
    dropped_.fetch_add(1);
  }
}

// ------------------------------------------------------------------- drain

uint64_t AllocatorRegistry::drain() {
  std::lock_guard<std::mutex> g(state_mu_);
  return drain_locked();
}

uint64_t AllocatorRegistry::drain_locked() {
  spare_.clear();
  {
    std::lock_guard<std::mutex> g(queue_mu_);
    std::swap(queue_, spare_);  // the queue keeps the spare's capacity
    in_flight_ = spare_.size();
  }
  uint64_t n = spare_.size();
  struct Done {  // even when apply() throws: waiters must not see a batch stuck in flight
    AllocatorRegistry* r;
    uint64_t n;
    ~Done() {
      std::lock_guard<std::mutex> g(r->queue_mu_);  // stats() reads both under it
      r->applied_.fetch_add(n, std::memory_order_relaxed);
      r->in_flight_ = 0;
      r->drained_cv_.notify_all();
    }
  } done{this, n};
  for (const TraceEvent& ev : spare_) apply(ev);
  if (spare_.capacity() > (1u << 20) && n < (1u << 16)) {
    std::vector<TraceEvent>().swap(spare_);  // do not pin a burst's memory forever
  } else {
    spare_.clear();
  }
  return n;
}

void AllocatorRegistry::cut_segments(Device& d, uint64_t lo, uint64_t hi) {
  if (hi <= lo) return;
  auto it = d.segs.upper_bound(lo);
  if (it != d.segs.begin()) {
    auto p = std::prev(it);
    if (p->second.addr + p->second.size > lo) it = p;
  }
  std::vector<SegmentRange> keep;
  while (it != d.segs.end() && it->second.addr < hi) {
    const SegmentRange s = it->second;
    uint64_t e = s.addr + s.size;
    if (e > lo) {
      if (s.addr < lo) {
        SegmentRange l = s;
        l.size = lo - s.addr;
        keep.push_back(l);
      }
      if (e > hi) {
        SegmentRange r = s;
        r.addr = hi;
        r.size = e - hi;
        keep.push_back(r);
      }
      it = d.segs.erase(it);
    } else {
      ++it;
    }
  }
  for (const SegmentRange& s : keep) d.segs[s.addr] = s;
}

void AllocatorRegistry::add_segment(Device& d, const SegmentRange& s0, bool mergeable) {
  if (s0.size == 0) return;
  cut_segments(d, s0.addr, s0.addr + s0.size);  // stale overlaps cannot both be right
  SegmentRange s = s0;
  s.expandable = mergeable;
  if (mergeable) {
    auto right = d.segs.find(s.addr + s.size);
    if (right != d.segs.end() && right->second.expandable && right->second.stream == s.stream &&
        right->second.pool == s.pool) {
      s.size += right->second.size;
      d.segs.erase(right);
    }
    auto it = d.segs.lower_bound(s.addr);
    if (it != d.segs.begin()) {
      auto left = std::prev(it);
      const SegmentRange& l = left->second;
      if (l.addr + l.size == s.addr && l.expandable && l.stream == s.stream && l.pool == s.pool) {
        left->second.size += s.size;
        return;
      }
    }
  }
  d.segs[s.addr] = s;
}

void AllocatorRegistry::drop_blocks_in(Device& d, uint64_t lo, uint64_t hi) {
  auto drop = [&](std::map<uint64_t, LiveBlock>& m) {
    bool any = false;
    auto it = m.lower_bound(lo);
    if (it != m.begin()) {
      auto p = std::prev(it);
      if (p->second.addr + p->second.size > lo) it = p;
    }
    while (it != m.end() && it->first < hi) {
      it = m.erase(it);
      any = true;
    }
    return any;
  };
  if (drop(d.live)) ++d.generation;
  drop(d.pending);
}

void AllocatorRegistry::apply(const TraceEvent& ev) {
  Device& d = dev(ev.device);
  const uint64_t lo = ev.addr, hi = ev.addr + ev.size;
  switch (ev.action) {
    case TraceAction::ALLOC: {
      if (!d.seeded) d.mentioned_blocks.insert(ev.addr);
      d.pending.erase(ev.addr);  // its FREE_COMPLETED was never seen
      d.live[ev.addr] = LiveBlock{ev.addr, ev.size, ev.stream, ev.pool};
      ++d.generation;
      break;
    }
    case TraceAction::FREE_REQUESTED: {
      if (!d.seeded) d.mentioned_blocks.insert(ev.addr);
      auto it = d.live.find(ev.addr);
      if (it == d.live.end()) {
        ignored_.fetch_add(1, std::memory_order_relaxed);
        break;
      }
      d.pending[ev.addr] = it->second;
      d.live.erase(it);
      ++d.generation;
      break;
    }
    case TraceAction::FREE_COMPLETED: {
      if (!d.seeded) d.mentioned_blocks.insert(ev.addr);
      if (d.pending.erase(ev.addr)) break;
      auto it = d.live.find(ev.addr);
      if (it == d.live.end()) {
        ignored_.fetch_add(1, std::memory_order_relaxed);
        break;
      }
      d.live.erase(it);
      ++d.generation;
      break;
    }
    case TraceAction::SEGMENT_ALLOC:
    case TraceAction::SEGMENT_MAP: {
      if (!d.seeded) d.mentioned_segs.emplace_back(lo, hi);
      SegmentRange s{ev.addr, ev.size, ev.stream, ev.pool, false};
      add_segment(d, s, ev.action == TraceAction::SEGMENT_MAP);
      break;
    }
    case TraceAction::SEGMENT_FREE:
    case TraceAction::SEGMENT_UNMAP: {
      if (!d.seeded) d.mentioned_segs.emplace_back(lo, hi);
      cut_segments(d, lo, hi);
      drop_blocks_in(d, lo, hi);  // none should be left; never keep a stale one
      break;
    }
    case TraceAction::SNAPSHOT:
    case TraceAction::OOM:
    case TraceAction::ANNOTATE:
      break;
    default:  // UNKNOWN, or an action a newer torch added
      ignored_.fetch_add(1, std::memory_order_relaxed);
      break;
  }
}

// -------------------------------------------------------------------- seed

uint64_t AllocatorRegistry::seed(int device, const std::vector<SeedSegment>& segments) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  Device& d = dev(device);
  uint64_t added = 0;
  for (const SeedSegment& ss : segments) {
    if (ss.size == 0) continue;
    std::vector<Interval> cuts;
    if (!d.seeded) cuts = d.mentioned_segs;
    for (const auto& kv : d.segs) cuts.emplace_back(kv.second.addr, kv.second.addr + kv.second.size);
    std::vector<Interval> pieces = subtract(ss.addr, ss.addr + ss.size, std::move(cuts));
    SegmentRange s{ss.addr, ss.size, ss.stream, ss.pool, ss.expandable};
    if (!ss.expandable) {
      if (pieces.size() == 1 && pieces[0] == Interval(ss.addr, ss.addr + ss.size))
        add_segment(d, s, false);
    } else {
      for (const Interval& p : pieces) {
        s.addr = p.first;
        s.size = p.second - p.first;
        add_segment(d, s, true);
      }
    }
  }
  for (const SeedSegment& ss : segments) {
    for (const SeedBlock& b : ss.blocks) {
      if (!b.allocated) continue;
      if (!d.seeded && d.mentioned_blocks.count(b.addr)) continue;  // the events know better
      if (d.live.count(b.addr)) continue;                             // duplicate
      if (b.size > 0 && block_containing(d, b.addr, b.addr + 1) != nullptr) {
        ignored_.fetch_add(1, std::memory_order_relaxed);  // overlaps a live block: stale
        continue;
      }
      auto next = d.live.lower_bound(b.addr);
      if (next != d.live.end() && next->first < b.addr + b.size) {
        ignored_.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      d.pending.erase(b.addr);
      d.live[b.addr] = LiveBlock{b.addr, b.size, ss.stream, ss.pool};
      ++added;
    }
  }
  if (added) ++d.generation;
  d.seeded = true;
  d.mentioned_blocks.clear();
  d.mentioned_segs.clear();
  d.mentioned_segs.shrink_to_fit();
  seeded_blocks_.fetch_add(added);
  return added;
}

bool AllocatorRegistry::seeded(int device) const {
  std::lock_guard<std::mutex> g(state_mu_);
  auto it = devs_.find(device);
  return it != devs_.end() && it->second.seeded;
}

// ----------------------------------------------------------------- queries

std::vector<LiveBlock> AllocatorRegistry::live_blocks(int device) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  std::vector<LiveBlock> out;
  auto it = devs_.find(device);
  if (it == devs_.end()) return out;
  out.reserve(it->second.live.size());
  for (const auto& kv : it->second.live) out.push_back(kv.second);
  return out;
}

std::vector<LiveBlock> AllocatorRegistry::pending_free(int device) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  std::vector<LiveBlock> out;
  auto it = devs_.find(device);
  if (it == devs_.end()) return out;
  for (const auto& kv : it->second.pending) out.push_back(kv.second);
  return out;
}

std::vector<SegmentRange> AllocatorRegistry::segments(int device) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  std::vector<SegmentRange> out;
  auto it = devs_.find(device);
  if (it == devs_.end()) return out;
  for (const auto& kv : it->second.segs) out.push_back(kv.second);
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
  auto it = devs_.find(device);
  return it == devs_.end() ? 0 : it->second.generation;
}

uint64_t AllocatorRegistry::watched_generation(int device) const {
  std::lock_guard<std::mutex> g(queue_mu_);
  auto it = watches_.find(device);
  return it == watches_.end() ? 0 : it->second.generation;
}

void AllocatorRegistry::watch(int device, const std::vector<Span>& spans) {
  std::vector<Interval> merged = merge_spans(spans);  // allocate outside the lock
  std::lock_guard<std::mutex> g(queue_mu_);
  Watch& w = watches_[device];
  w.spans.swap(merged);
  ++w.generation;
}

const LiveBlock* AllocatorRegistry::block_containing(const Device& d, uint64_t lo,
                                                     uint64_t hi) const {
  auto it = d.live.upper_bound(lo);
  if (it == d.live.begin()) return nullptr;
  const LiveBlock& b = std::prev(it)->second;
  if (b.addr <= lo && hi <= b.addr + b.size) return &b;
  return nullptr;
}

const SegmentRange* AllocatorRegistry::segment_containing(const Device& d, uint64_t lo,
                                                          uint64_t hi) const {
  auto it = d.segs.upper_bound(lo);
  if (it == d.segs.begin()) return nullptr;
  const SegmentRange& s = std::prev(it)->second;
  if (s.addr <= lo && hi <= s.addr + s.size) return &s;
  return nullptr;
}

CoverageReport AllocatorRegistry::coverage(int device, const std::vector<Span>& spans,
                                           size_t top_n) {
  std::vector<Interval> merged = merge_spans(spans);
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  CoverageReport r;
  for (const Interval& iv : merged) r.span_bytes += iv.second - iv.first;
  auto dit = devs_.find(device);
  if (dit == devs_.end()) {
    r.outside_bytes = r.span_bytes;
    return r;
  }
  const Device& d = dit->second;
  r.pending_free_blocks = d.pending.size();
  std::vector<LiveBlock> uncovered;
  size_t j = 0;
  for (const auto& kv : d.live) {
    const LiveBlock& b = kv.second;
    const uint64_t be = b.addr + b.size;
    r.live_bytes += b.size;
    ++r.live_blocks;
    while (j < merged.size() && merged[j].second <= b.addr) ++j;
    uint64_t cov = 0;
    for (size_t k = j; k < merged.size() && merged[k].first < be; ++k)
      cov += std::min(be, merged[k].second) - std::max(b.addr, merged[k].first);
    r.covered_bytes += cov;
    if (cov == 0 && b.size > 0) uncovered.push_back(b);
  }
  r.uncovered_bytes = r.live_bytes - r.covered_bytes;
  r.uncovered_blocks = uncovered.size();
  r.outside_bytes = r.span_bytes - r.covered_bytes;
  size_t n = std::min(top_n, uncovered.size());
  std::partial_sort(uncovered.begin(), uncovered.begin() + n, uncovered.end(),
                    [](const LiveBlock& a, const LiveBlock& b) {
                      return a.size != b.size ? a.size > b.size : a.addr < b.addr;
                    });
  uncovered.resize(n);
  r.largest_uncovered = std::move(uncovered);
  return r;
}

std::vector<LocateResult> AllocatorRegistry::locate(int device, const std::vector<Span>& spans) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  std::vector<LocateResult> out(spans.size());
  auto dit = devs_.find(device);
  static const Device kEmpty;
  const Device& d = dit == devs_.end() ? kEmpty : dit->second;
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    LocateResult& r = out[i];
    if (s.nbytes == 0) {
      r.ok = true;  // nothing to copy
      continue;
    }
    const uint64_t lo = s.addr, hi = s.addr + s.nbytes;
    if (const LiveBlock* b = block_containing(d, lo, hi)) {
      r.ok = true;
      r.block = *b;
      if (const SegmentRange* sg = segment_containing(d, b->addr, b->addr + b->size))
        r.segment = *sg;
      continue;
    }
    std::ostringstream os;
    os << span_name(i, s) << " on cuda:" << device << ": ";
    auto it = d.live.upper_bound(lo);
    const LiveBlock* prev = it == d.live.begin() ? nullptr : &std::prev(it)->second;
    auto pit = d.pending.upper_bound(lo);
    const LiveBlock* pend = pit == d.pending.begin() ? nullptr : &std::prev(pit)->second;
    if (prev && prev->addr <= lo && lo < prev->addr + prev->size) {
      os << "extends past the end of live block [" << hex(prev->addr) << ", +" << prev->size
         << ")";
    } else if (pend && pend->addr <= lo && lo < pend->addr + pend->size) {
      os << "lies in block [" << hex(pend->addr) << ", +" << pend->size
         << ") whose free was requested (pending free): the tensor is dead";
    } else {
      os << "is not inside any live block the allocator registry tracks (a tensor of a "
            "private CUDA-graph pool, memory not from the caching allocator, or another "
            "device); use named-tensor spans";
    }
    r.error = os.str();
  }
  return out;
}

Coalesced AllocatorRegistry::coalesce(int device, const std::vector<Span>& spans,
                                      uint64_t merge_gap) {
  std::lock_guard<std::mutex> g(state_mu_);
  drain_locked();
  Coalesced out;
  out.placement.assign(spans.size(), {-1, 0});
  auto dit = devs_.find(device);
  static const Device kEmpty;
  const Device& d = dit == devs_.end() ? kEmpty : dit->second;
  // container: 1 + segment start, or (1 << 63) | block start, or 0 for none.
  constexpr uint64_t kBlockTag = 1ull << 63;
  std::vector<size_t> idx;
  std::vector<uint64_t> cont(spans.size(), 0);
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    if (s.nbytes == 0) continue;
    idx.push_back(i);
    const uint64_t lo = s.addr, hi = s.addr + s.nbytes;
    if (const SegmentRange* sg = segment_containing(d, lo, hi))
      cont[i] = sg->addr + 1;
    else if (const LiveBlock* b = block_containing(d, lo, hi))
      cont[i] = kBlockTag | b->addr;
  }
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    return std::tie(spans[a].addr, spans[a].nbytes) < std::tie(spans[b].addr, spans[b].nbytes);
  });
  uint64_t cur_lo = 0, cur_hi = 0, cur_cont = 0;
  std::vector<size_t> members;
  auto flush = [&] {
    if (members.empty()) return;
    int64_t ri = static_cast<int64_t>(out.ranges.size());
    out.ranges.push_back(Span{cur_lo, cur_hi - cur_lo});
    for (size_t m : members) out.placement[m] = {ri, spans[m].addr - cur_lo};
    members.clear();
  };
  for (size_t i : idx) {
    const Span& s = spans[i];
    const uint64_t lo = s.addr, hi = s.addr + s.nbytes;
    bool merge = false;
    if (!members.empty()) {
      if (lo < cur_hi) {
        merge = true;  // overlapping: the same memory
        if (cont[i] != cur_cont) cur_cont = 0;
      } else if (cur_cont != 0 && cont[i] == cur_cont && lo - cur_hi <= merge_gap) {
        merge = true;
      }
    }
    if (merge) {
      cur_hi = std::max(cur_hi, hi);
    } else {
      flush();
      cur_lo = lo;
      cur_hi = hi;
      cur_cont = cont[i];
    }
    members.push_back(i);
  }
  flush();
  return out;
}

RegistryStats AllocatorRegistry::stats() const {
  RegistryStats s;
  // One consistent view: record() and the end of a drain update these under queue_mu_.
  std::lock_guard<std::mutex> g(queue_mu_);
  s.recorded = recorded_.load();
  s.applied = applied_.load();
  s.ignored = ignored_.load();
  s.dropped = dropped_.load();
  s.seeded_blocks = seeded_blocks_.load();
  s.queued = queue_.size() + in_flight_;  // a batch being applied is still queued
  return s;
}

// -------------------------------------------------------------- auto drain

void AllocatorRegistry::start_auto_drain(uint64_t threshold) {
  CUDASNAP_CHECK(threshold > 0, "auto-drain threshold must be positive");
  std::lock_guard<std::mutex> g(queue_mu_);
  auto_threshold_ = threshold;
  auto_stop_ = false;
  if (!auto_thread_.joinable()) auto_thread_ = std::thread([this] { auto_drain_loop(); });
  drain_cv_.notify_one();
}

void AllocatorRegistry::stop_auto_drain() {
  {
    std::lock_guard<std::mutex> g(queue_mu_);
    if (!auto_thread_.joinable()) return;
    auto_stop_ = true;
  }
  drain_cv_.notify_all();
  auto_thread_.join();
  std::lock_guard<std::mutex> g(queue_mu_);
  auto_threshold_ = 0;
  auto_stop_ = false;
  drained_cv_.notify_all();  // waiters: nothing more will be drained for them
}

bool AllocatorRegistry::wait_auto_drained(double timeout_s) {
  std::unique_lock<std::mutex> lk(queue_mu_);
  auto idle = [&] {
    return auto_threshold_ == 0 ||
           queue_.size() + in_flight_ < auto_threshold_;
  };
  if (timeout_s < 0) {
    drained_cv_.wait(lk, idle);
    return true;
  }
  return drained_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), idle);
}

void AllocatorRegistry::auto_drain_loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(queue_mu_);
      drain_cv_.wait(lk, [&] {
        return auto_stop_ || (auto_threshold_ && queue_.size() >= auto_threshold_);
      });
      if (auto_stop_) return;
    }
    try {
      drain();
    } catch (...) {
      dropped_.fetch_add(1);  // an allocation failure while applying: unreliable
    }
  }
}

}  // namespace cudasnap
