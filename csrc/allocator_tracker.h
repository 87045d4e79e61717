// Registry of live CUDA caching-allocator blocks.
//
// Pure C++ (no torch, no CUDA): compiled in every build and tested with
// synthetic trace events. The CUDA hook (cuda/tracker_hook.cpp) feeds it from
// c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker and seeds it
// from CUDACachingAllocator::snapshot().
//
// Two locks, always taken in the order state_mu_ -> queue_mu_:
//   * queue_mu_ (tiny): record() appends one event, and checks a free against
//     the watched spans (binary search, no allocation beyond the queue's
//     amortised growth). record() is what the allocator callback calls, under
//     the allocator's per-device mutex, possibly holding the GIL: it never
//     calls into PyTorch or Python and never blocks on anything but queue_mu_.
//   * state_mu_: drain() moves the queue out (O(1) swap) and applies it to
//     the per-device maps; every query drains first.
//
// Semantics:
//   * A block is live from ALLOC until FREE_REQUESTED. FREE_REQUESTED moves it
//     to a pending-free map (the allocator may still wait on other streams via
//     record_stream before FREE_COMPLETED reuses it): pending-free blocks are
//     NOT live, not in coverage, not locatable, and must not be in a copy
//     plan. FREE_COMPLETED drops it from pending (or from live, if its
//     FREE_REQUESTED was never seen).
//   * generation(d) increments on every change to d's live set (applied at
//     drain time).
//   * watched_generation(d) increments only when a block or segment range
//     overlapping one of d's watched spans is freed (FREE_REQUESTED,
//     FREE_COMPLETED) or unmapped (SEGMENT_FREE, SEGMENT_UNMAP), and on every
//     watch(d, ...). It is bumped in record() itself, so reading it is O(1) and
//     needs no drain: a cached copy plan stays valid as long as this integer
//     is unchanged, however much the activations churn. It does not detect
//     NEW state tensors (e.g. Adam's lazily created moments): the caller must
//     notice a changed set of state tensors itself.
//   * Segments: a SEGMENT_ALLOC range (cudaMalloc) is a segment of its own and
//     never merges with a VA-adjacent one. SEGMENT_MAP ranges (expandable
//     segments) merge with adjacent mapped ranges of the same stream and pool,
//     so a segment is always one contiguous, fully mapped range; SEGMENT_UNMAP
//     and SEGMENT_FREE cut a sub-range out of whatever segments overlap it.
//   * seed(d, segments) applies a CUDACachingAllocator::snapshot() taken
//     AFTER the tracker was attached. It drains first, then adds each
//     allocated snapshot block whose address no ALLOC/FREE event of d has
//     mentioned since the registry was created (the event stream is the truth
//     for every address it mentions; an unmentioned block in a later snapshot
//     must predate the attach and still be live), and likewise each snapshot
//     segment range not overlapping a range mentioned by a segment event.
//     Mention tracking stops once d is seeded; a second seed only
//     de-duplicates by address against the live set.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace cudasnap {

// Mirrors c10::CachingDeviceAllocator::TraceEntry::Action (same order), plus
// UNKNOWN for actions a newer torch may add.
enum class TraceAction : int {
  ALLOC = 0,
  FREE_REQUESTED,
  FREE_COMPLETED,
  SEGMENT_ALLOC,
  SEGMENT_FREE,
  SEGMENT_MAP,
  SEGMENT_UNMAP,
  SNAPSHOT,
  OOM,
  ANNOTATE,
  UNKNOWN,
};

using PoolId = std::pair<uint64_t, uint64_t>;  // c10 MempoolId_t

// "alloc", "free_requested", ... (c10's trace names); UNKNOWN -> "unknown".
const char* trace_action_name(TraceAction a) noexcept;
// Inverse of trace_action_name (case-insensitive); false when not a name.
bool parse_trace_action(const std::string& name, TraceAction* out) noexcept;

struct TraceEvent {
  TraceAction action = TraceAction::UNKNOWN;
  int device = 0;
  uint64_t addr = 0;
  uint64_t size = 0;
  uint64_t stream = 0;
  PoolId pool{0, 0};
};

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
};

struct Span {
  uint64_t addr = 0;
  uint64_t nbytes = 0;
};

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

struct RegistryStats {
  uint64_t recorded = 0;   // events accepted by record()
  uint64_t applied = 0;    // events applied by drain()
  uint64_t ignored = 0;    // unknown actions, frees of untracked addresses, ...
  uint64_t dropped = 0;    // events record() could not queue (out of memory)
  uint64_t queued = 0;     // events waiting for drain()
  uint64_t seeded_blocks = 0;
};

class AllocatorRegistry {
 public:
  AllocatorRegistry() = default;
  ~AllocatorRegistry();
  AllocatorRegistry(const AllocatorRegistry&) = delete;
  AllocatorRegistry& operator=(const AllocatorRegistry&) = delete;

  // Callback entry point: queue one event. noexcept; never blocks beyond
  // queue_mu_. An event that cannot be queued is counted in stats().dropped
  // (the registry is then unreliable: healthy() turns false).
  void record(const TraceEvent& ev) noexcept;

  // Applies every queued event; returns how many.
  uint64_t drain();
  // Seeds pre-existing blocks of `device` (see the header comment); returns
  // how many blocks were added.
  uint64_t seed(int device, const std::vector<SeedSegment>& segments);
  bool seeded(int device) const;

  std::vector<LiveBlock> live_blocks(int device);
  std::vector<LiveBlock> pending_free(int device);
  std::vector<SegmentRange> segments(int device);
  std::vector<int> devices();
  uint64_t generation(int device);
  uint64_t watched_generation(int device) const;

  // Replaces the watched spans of `device`; bumps its watched_generation.
  void watch(int device, const std::vector<Span>& spans);

  CoverageReport coverage(int device, const std::vector<Span>& spans, size_t top_n = 8);
  std::vector<LocateResult> locate(int device, const std::vector<Span>& spans);
  // Merges spans lying in the same segment (or, with no segment known, the
  // same live block) whose gaps are <= merge_gap. Spans that overlap are
  // always merged (same memory). Never merges across segments.
  Coalesced coalesce(int device, const std::vector<Span>& spans, uint64_t merge_gap);

  RegistryStats stats() const;
  bool healthy() const { return dropped_.load() == 0; }

  // A background thread that drains whenever `threshold` events are queued,
  // so the queue stays bounded without the trainer paying for it.
  void start_auto_drain(uint64_t threshold);
  void stop_auto_drain();
  // Blocks (at most timeout_s) until the auto-drain thread has APPLIED all but
  // fewer than `threshold` of the events recorded so far, or auto drain is off.
  // Signalled by the drain thread after each drain (no polling). True when so.
  bool wait_auto_drained(double timeout_s);

 private:
  struct Device {
    std::map<uint64_t, LiveBlock> live;
    std::map<uint64_t, LiveBlock> pending;
    std::map<uint64_t, SegmentRange> segs;  // by start address, disjoint
    uint64_t generation = 0;
    bool seeded = false;
    std::unordered_set<uint64_t> mentioned_blocks;           // until seeded
    std::vector<std::pair<uint64_t, uint64_t>> mentioned_segs;  // [lo, hi), until seeded
  };
  struct Watch {
    std::vector<std::pair<uint64_t, uint64_t>> spans;  // merged, sorted [lo, hi)
    uint64_t generation = 0;
  };

  uint64_t drain_locked();  // state_mu_ held
  void apply(const TraceEvent& ev);
  Device& dev(int device) { return devs_[device]; }
  void cut_segments(Device& d, uint64_t lo, uint64_t hi);
  void add_segment(Device& d, const SegmentRange& s, bool mergeable);
  void drop_blocks_in(Device& d, uint64_t lo, uint64_t hi);
  const SegmentRange* segment_containing(const Device& d, uint64_t lo, uint64_t hi) const;
  const LiveBlock* block_containing(const Device& d, uint64_t lo, uint64_t hi) const;
  static bool overlaps(const std::vector<std::pair<uint64_t, uint64_t>>& merged, uint64_t lo,
                       uint64_t hi);
  void auto_drain_loop();

  // queue side
  mutable std::mutex queue_mu_;
  std::vector<TraceEvent> queue_;
  std::unordered_map<int, Watch> watches_;
  std::condition_variable drain_cv_;     // record() -> drain thread: threshold reached
  std::condition_variable drained_cv_;   // drain() -> waiters: a batch was applied
  uint64_t in_flight_ = 0;               // moved out of queue_, not yet applied
  uint64_t auto_threshold_ = 0;  // 0: no auto drain
  bool auto_stop_ = false;
  std::thread auto_thread_;

  // state side
  mutable std::mutex state_mu_;
  std::vector<TraceEvent> spare_;
  std::map<int, Device> devs_;

  std::atomic<uint64_t> recorded_{0};
  std::atomic<uint64_t> applied_{0};
  std::atomic<uint64_t> ignored_{0};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> seeded_blocks_{0};
};

}  // namespace cudasnap
