// Per-device memory map of the CUDA caching allocator: live blocks,
// pending-free blocks and segments, built by applying trace events.
//
// Pure C++ (no torch, no CUDA), no locking of its own: the AllocatorRegistry
// (allocator_tracker.h) applies queued events to it under its state lock.
//
// Semantics:
//   * A block is live from ALLOC until FREE_REQUESTED. FREE_REQUESTED moves it
//     to a pending-free map (the allocator may still wait on other streams via
//     record_stream before FREE_COMPLETED reuses it): pending-free blocks are
//     NOT live, not in coverage, not locatable, and must not be in a copy
//     plan. FREE_COMPLETED drops it from pending (or from live, if its
//     FREE_REQUESTED was never seen).
//   * generation increments on every change to the live set.
//   * Segments: a SEGMENT_ALLOC range (cudaMalloc) is a segment of its own and
//     never merges with a VA-adjacent one. SEGMENT_MAP ranges (expandable
//     segments) merge with adjacent mapped ranges of the same stream and pool,
//     so a segment is always one contiguous, fully mapped range; SEGMENT_UNMAP
//     and SEGMENT_FREE cut a sub-range out of whatever segments overlap it.
//   * seed(segments) applies a CUDACachingAllocator::snapshot() taken AFTER
//     the tracker was attached: it adds each allocated snapshot block whose
//     address no ALLOC/FREE event has mentioned since the map was created (the
//     event stream is the truth for every address it mentions; an unmentioned
//     block in a later snapshot must predate the attach and still be live),
//     and likewise each snapshot segment range not overlapping a range
//     mentioned by a segment event. Mention tracking stops once seeded; a
//     second seed only de-duplicates by address against the live set.
#pragma once

#include <cstdint>
#include <map>
#include <unordered_set>
#include <vector>

#include "allocator_events.h"

namespace cudasnap {

struct LiveBlock {
  uint64_t addr = 0;
  uint64_t size = 0;  // requested size (what the tensor may use)
  uint64_t stream = 0;
  PoolId pool{0, 0};
};

struct SegmentRange {
  uint64_t addr = 0;
  uint64_t size = 0;
  uint64_t stream = 0;
  PoolId pool{0, 0};
  bool expandable = false;
};

struct SeedBlock {
  uint64_t addr = 0;
  uint64_t size = 0;  // requested size, or the block size when unknown
  bool allocated = false;
};

struct SeedSegment {
  uint64_t addr = 0;
  uint64_t size = 0;
  uint64_t stream = 0;
  PoolId pool{0, 0};
  bool expandable = false;
  std::vector<SeedBlock> blocks;

  // Appends the next block of a snapshot segment. Blocks are contiguous from
  // the segment start: `addr` < 0 means "where the previous block ended".
  // The block keeps its requested size (what the tensor may use), or
  // `block_size` when that is unknown (0).
  void add_block(int64_t addr, uint64_t block_size, uint64_t requested_size, bool allocated);
  // Where the next block starts (add_block keeps it; set it to addr first).
  uint64_t next_block_addr = 0;
};

// One device's memory map.
struct DeviceMemory {
  std::map<uint64_t, LiveBlock> live;
  std::map<uint64_t, LiveBlock> pending;
  std::map<uint64_t, SegmentRange> segs;  // by start address, disjoint
  uint64_t generation = 0;
  bool seeded = false;
  std::unordered_set<uint64_t> mentioned_blocks;  // until seeded
  std::vector<Interval> mentioned_segs;           // until seeded

  // Applies one event; false when it was ignored (unknown action, a free of
  // an untracked address).
  bool apply(const TraceEvent& ev);
  // Seeds pre-existing blocks (see the header comment). Returns the blocks
  // added; adds to *ignored the stale ones skipped.
  uint64_t seed(const std::vector<SeedSegment>& segments, uint64_t* ignored);

  // The live block / segment wholly containing [lo, hi), or null.
  const LiveBlock* block_containing(uint64_t lo, uint64_t hi) const;
  const SegmentRange* segment_containing(uint64_t lo, uint64_t hi) const;

 private:
  void cut_segments(uint64_t lo, uint64_t hi);
  void add_segment(const SegmentRange& s, bool mergeable);
  void drop_blocks_in(uint64_t lo, uint64_t hi);
};

}  // namespace cudasnap
