// Registry of live CUDA caching-allocator blocks: the facade over three parts.
//
//   allocator_events.h  TraceEvent, EventQueue (record(), the auto-drain thread)
//   device_map.h        DeviceMemory: live / pending-free blocks and segments
//                       per device, built by applying events; seeding
//   span_query.h        coverage, locate, coalesce of spans on one device
//
// Pure C++ (no torch, no CUDA): compiled in every build and tested with
// synthetic trace events. The CUDA hook (cuda/tracker_hook.cpp) feeds it from
// c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker and seeds it
// from CUDACachingAllocator::snapshot().
//
// Two locks, always taken in the order state_mu_ -> the queue's lock:
//   * the EventQueue's (tiny): record() appends one event; what the allocator
//     callback calls.
//   * state_mu_: drain() takes the queue (O(1) swap) and applies it to the
//     per-device maps; every query drains first.
//
//   * generation(d) increments on every change to d's live set (applied at
//     drain time).
//   * seed(d, segments): see device_map.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "allocator_events.h"
#include "device_map.h"
#include "span_query.h"

namespace cudasnap {

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

  // Callback entry point: queue one event (EventQueue::record).
  void record(const TraceEvent& ev) noexcept { queue_.record(ev); }

  // Applies every queued event; returns how many.
  uint64_t drain();
  // Seeds pre-existing blocks of `device` (device_map.h); returns how many
  // blocks were added.
  uint64_t seed(int device, const std::vector<SeedSegment>& segments);
  bool seeded(int device) const;

  std::vector<LiveBlock> live_blocks(int device);
  std::vector<LiveBlock> pending_free(int device);
  std::vector<SegmentRange> segments(int device);
  std::vector<int> devices();
  uint64_t generation(int device);


  CoverageReport coverage(int device, const std::vector<Span>& spans, size_t top_n = 8);
  // `strict`: the first span not located throws (its error), instead of a
  // result with ok false.
  std::vector<LocateResult> locate(int device, const std::vector<Span>& spans,
                                   bool strict = false);
  Coalesced coalesce(int device, const std::vector<Span>& spans, uint64_t merge_gap);

  RegistryStats stats() const;
  bool healthy() const { return queue_.healthy(); }

  // EventQueue's auto drain, draining into this registry.
  void start_auto_drain(uint64_t threshold);
  void stop_auto_drain() { queue_.stop_auto_drain(); }
  bool wait_auto_drained(double timeout_s) { return queue_.wait_auto_drained(timeout_s); }

 private:
  uint64_t drain_locked();  // state_mu_ held
  const DeviceMemory* find(int device) const;

  EventQueue queue_;

  mutable std::mutex state_mu_;
  std::vector<TraceEvent> spare_;
  std::map<int, DeviceMemory> devs_;
  std::atomic<uint64_t> ignored_{0};
  std::atomic<uint64_t> seeded_blocks_{0};
};

}  // namespace cudasnap
