// Allocator trace events and the queue the allocator callback feeds.
//
// Pure C++ (no torch, no CUDA). EventQueue is the "queue side" of the
// AllocatorRegistry (allocator_tracker.h): record() is what the caching
// allocator's trace callback calls, under the allocator's per-device mutex,
// possibly holding the GIL: it never calls into PyTorch or Python and never
// blocks on anything but the queue's own small mutex. It also runs the
// optional auto-drain thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
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
using Interval = std::pair<uint64_t, uint64_t>;  // [lo, hi)

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

struct Span {
  uint64_t addr = 0;
  uint64_t nbytes = 0;
};

// Sorted, merged, non-empty intervals of `spans`.
std::vector<Interval> merge_spans(const std::vector<Span>& spans);
// Whether [lo, hi) overlaps one of the sorted, disjoint intervals `merged`.

struct QueueCounts {
  uint64_t recorded = 0;  // events accepted by record()
  uint64_t applied = 0;   // events reported applied (finish_batch)
  uint64_t dropped = 0;   // events record() could not queue, or batches failed to apply
  uint64_t queued = 0;    // queued plus the batch being applied
};

class EventQueue {
 public:
  EventQueue() = default;
  ~EventQueue();
  EventQueue(const EventQueue&) = delete;
  EventQueue& operator=(const EventQueue&) = delete;

  // Queues one event. noexcept: an event that cannot be queued is counted in
  // counts().dropped.
  void record(const TraceEvent& ev) noexcept;
  // Moves every queued event into `out` (swapped: the queue keeps out's
  // capacity) and marks them in flight until finish_batch().
  void take(std::vector<TraceEvent>& out);
  // The batch of `n` events taken last is applied (also when applying threw).
  void finish_batch(uint64_t n);
  void count_dropped() noexcept { dropped_.fetch_add(1); }
  bool healthy() const { return dropped_.load() == 0; }
  QueueCounts counts() const;  // one consistent view

  // A background thread that calls `drain` whenever `threshold` events are
  // queued, so the queue stays bounded without the trainer paying for it.
  // `drain` failing counts as a dropped event (the registry is unreliable).
  void start_auto_drain(uint64_t threshold, std::function<void()> drain);
  void stop_auto_drain();
  // Blocks (at most timeout_s; < 0: no bound) until all but fewer than
  // `threshold` of the events recorded so far are applied, or auto drain is
  // off. Signalled after each batch (no polling). True when so.
  bool wait_auto_drained(double timeout_s);

 private:
  void auto_drain_loop();

  mutable std::mutex mu_;
  std::vector<TraceEvent> queue_;
  std::condition_variable drain_cv_;    // record() -> drain thread: threshold reached
  std::condition_variable drained_cv_;  // finish_batch() -> waiters: a batch was applied
  uint64_t in_flight_ = 0;              // taken, not yet applied
  uint64_t auto_threshold_ = 0;         // 0: no auto drain
  bool auto_stop_ = false;
  std::function<void()> auto_drain_fn_;
  std::thread auto_thread_;

  std::atomic<uint64_t> recorded_{0};
  std::atomic<uint64_t> applied_{0};
  std::atomic<uint64_t> dropped_{0};
};

}  // namespace cudasnap
