#include "span_query.h"

#include <algorithm>
#include <iterator>
#include <sstream>
#include <tuple>

namespace cudasnap {

namespace {

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

CoverageReport coverage(const DeviceMemory* dm, const std::vector<Interval>& merged,
                        size_t top_n) {
  CoverageReport r;
  for (const Interval& iv : merged) r.span_bytes += iv.second - iv.first;
  if (dm == nullptr) {
    r.outside_bytes = r.span_bytes;
    return r;
  }
  const DeviceMemory& d = *dm;
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

std::vector<LocateResult> locate(const DeviceMemory& d, int device,
                                 const std::vector<Span>& spans) {
  std::vector<LocateResult> out(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    LocateResult& r = out[i];
    if (s.nbytes == 0) {
      r.ok = true;  // nothing to copy
      continue;
    }
    const uint64_t lo = s.addr, hi = s.addr + s.nbytes;
    if (const LiveBlock* b = d.block_containing(lo, hi)) {
      r.ok = true;
      r.block = *b;
      if (const SegmentRange* sg = d.segment_containing(b->addr, b->addr + b->size))
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

Coalesced coalesce(const DeviceMemory& d, const std::vector<Span>& spans, uint64_t merge_gap) {
  Coalesced out;
  out.placement.assign(spans.size(), {-1, 0});
  // container: 1 + segment start, or (1 << 63) | block start, or 0 for none.
  constexpr uint64_t kBlockTag = 1ull << 63;
  std::vector<size_t> idx;
  std::vector<uint64_t> cont(spans.size(), 0);
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    if (s.nbytes == 0) continue;
    idx.push_back(i);
    const uint64_t lo = s.addr, hi = s.addr + s.nbytes;
    if (const SegmentRange* sg = d.segment_containing(lo, hi))
      cont[i] = sg->addr + 1;
    else if (const LiveBlock* b = d.block_containing(lo, hi))
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

}  // namespace cudasnap
