#include "device_map.h"

#include <algorithm>
#include <iterator>

namespace cudasnap {

namespace {

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

}  // namespace

void DeviceMemory::cut_segments(uint64_t lo, uint64_t hi) {
  DeviceMemory& d = *this;
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

void DeviceMemory::add_segment(const SegmentRange& s0, bool mergeable) {
  DeviceMemory& d = *this;
  if (s0.size == 0) return;
  cut_segments(s0.addr, s0.addr + s0.size);  // stale overlaps cannot both be right
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

void DeviceMemory::drop_blocks_in(uint64_t lo, uint64_t hi) {
  DeviceMemory& d = *this;
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

bool DeviceMemory::apply(const TraceEvent& ev) {
  DeviceMemory& d = *this;
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
        return false;
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
        return false;
      }
      d.live.erase(it);
      ++d.generation;
      break;
    }
    case TraceAction::SEGMENT_ALLOC:
    case TraceAction::SEGMENT_MAP: {
      if (!d.seeded) d.mentioned_segs.emplace_back(lo, hi);
      SegmentRange s{ev.addr, ev.size, ev.stream, ev.pool, false};
      add_segment(s, ev.action == TraceAction::SEGMENT_MAP);
      break;
    }
    case TraceAction::SEGMENT_FREE:
    case TraceAction::SEGMENT_UNMAP: {
      if (!d.seeded) d.mentioned_segs.emplace_back(lo, hi);
      cut_segments(lo, hi);
      drop_blocks_in(lo, hi);  // none should be left; never keep a stale one
      break;
    }
    case TraceAction::SNAPSHOT:
    case TraceAction::OOM:
    case TraceAction::ANNOTATE:
      break;
    default:  // UNKNOWN, or an action a newer torch added
      return false;
  }
  return true;
}

void SeedSegment::add_block(int64_t block_addr, uint64_t block_size, uint64_t requested_size,
                            bool allocated) {
  SeedBlock b;
  b.addr = block_addr >= 0 ? static_cast<uint64_t>(block_addr) : next_block_addr;
  b.size = requested_size ? requested_size : block_size;
  b.allocated = allocated;
  next_block_addr = b.addr + block_size;
  blocks.push_back(b);
}

uint64_t DeviceMemory::seed(const std::vector<SeedSegment>& segments, uint64_t* ignored) {
  DeviceMemory& d = *this;
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
        add_segment(s, false);
    } else {
      for (const Interval& p : pieces) {
        s.addr = p.first;
        s.size = p.second - p.first;
        add_segment(s, true);
      }
    }
  }
  for (const SeedSegment& ss : segments) {
    for (const SeedBlock& b : ss.blocks) {
      if (!b.allocated) continue;
      if (!d.seeded && d.mentioned_blocks.count(b.addr)) continue;  // the events know better
      if (d.live.count(b.addr)) continue;                             // duplicate
      if (b.size > 0 && block_containing(b.addr, b.addr + 1) != nullptr) {
        ++*ignored;  // overlaps a live block: stale
        continue;
      }
      auto next = d.live.lower_bound(b.addr);
      if (next != d.live.end() && next->first < b.addr + b.size) {
        ++*ignored;
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
  return added;
}

const LiveBlock* DeviceMemory::block_containing(uint64_t lo, uint64_t hi) const {
  const DeviceMemory& d = *this;
  auto it = d.live.upper_bound(lo);
  if (it == d.live.begin()) return nullptr;
  const LiveBlock& b = std::prev(it)->second;
  if (b.addr <= lo && hi <= b.addr + b.size) return &b;
  return nullptr;
}

const SegmentRange* DeviceMemory::segment_containing(uint64_t lo, uint64_t hi) const {
  const DeviceMemory& d = *this;
  auto it = d.segs.upper_bound(lo);
  if (it == d.segs.begin()) return nullptr;
  const SegmentRange& s = std::prev(it)->second;
  if (s.addr <= lo && hi <= s.addr + s.size) return &s;
  return nullptr;
}

}  // namespace cudasnap
