// Queries of tensor spans against one device's memory map (device_map.h):
// coverage (how much live memory the spans hold), locate (the live block and
// segment of each span, or why none), coalesce (merge spans into copy ranges
// that never cross a segment). Pure functions, no locking: the
// AllocatorRegistry calls them under its state lock after a drain.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "allocator_events.h"
#include "device_map.h"

namespace cudasnap {

struct CoverageReport {
  uint64_t live_bytes = 0;          // sum of live block sizes
  uint64_t covered_bytes = 0;       // live block bytes inside the union of the spans
  uint64_t uncovered_bytes = 0;     // live_bytes - covered_bytes
  uint64_t live_blocks = 0;
  uint64_t uncovered_blocks = 0;    // live blocks no span touches
  uint64_t span_bytes = 0;          // bytes of the union of the spans
  uint64_t outside_bytes = 0;       // span bytes in no live block (private pool, not tracked)
  uint64_t pending_free_blocks = 0;
  std::vector<LiveBlock> largest_uncovered;  // fully uncovered blocks, largest first
};

struct LocateResult {
  bool ok = false;
  LiveBlock block;          // the live block containing the span (when ok)
  SegmentRange segment;     // its segment, size 0 when unknown
  std::string error;        // why not (when !ok)
};

struct Coalesced {
  std::vector<Span> ranges;  // sorted by address
  // per input span: (index into ranges, byte offset of the span in that range);
  // index -1 for a zero-byte span
  std::vector<std::pair<int64_t, uint64_t>> placement;
};

// `merged`: merge_spans() of the spans; `d` null for a device never seen.
CoverageReport coverage(const DeviceMemory* d, const std::vector<Interval>& merged, size_t top_n);
// `device` names the device in the error messages.
std::vector<LocateResult> locate(const DeviceMemory& d, int device, const std::vector<Span>& spans);
// Merges spans lying in the same segment (or, with no segment known, the
// same live block) whose gaps are <= merge_gap. Spans that overlap are
// always merged (same memory). Never merges across segments.
Coalesced coalesce(const DeviceMemory& d, const std::vector<Span>& spans, uint64_t merge_gap);

}  // namespace cudasnap
