// The engine's one thread-pool scheme.
//
// A Batch is n items run by whichever threads call work() on it: each thread
// claims the next item (one atomic counter) until none is left. Two drivers:
//   * parallel_for / run_batch: the caller plus up to threads-1 threads
//     started for the call, joined before it returns (the flusher's writers and
//     readers, the CUDA engine's CRC threads);
//   * WorkerPool: persistent workers (optionally at a lower priority) that
//     run each posted batch (the CPU copy engine).
// Batch policy, the same for every user:
//   * the first exception an item throws stops further claims; parallel_for
//     rethrows it once every thread has stopped (Batch::rethrow);
//   * yield (BatchOptions::should_yield): while the predicate returns true
//     something else gets the cores and memory bandwidth: one thread (the first
//     to ask) keeps running items, pausing `yield_pause_us` after each; the
//     others wait (500 us sleeps) until the predicate turns false or no item is
//     left. Asked again at every item. The pool knows nothing of what it yields
//     to: the copy engines pass flush_running (flusher.h), so that a flush in
//     this process gets the machine (flush-yield).
// Cancellation and bounded waits stay with the callers (a cancelled copy job
// still runs its items, skipping the copy, so its completion is counted).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace cudasnap {

// Whether a batch should yield now; asked by every thread before every item,
// so it must be cheap (an atomic load) and must not throw.
using YieldPredicate = bool (*)();

struct BatchOptions {
  YieldPredicate should_yield = nullptr;  // nullptr: never yield
  uint64_t yield_pause_us = 100;
};

class Batch {
 public:
  using Fn = std::function<void(uint64_t)>;
  Batch(uint64_t n, Fn fn, BatchOptions opts = {});
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  // Runs items on the calling thread until none is left to claim (or an item
  // failed). `worker` is unique among the threads running this batch.
  void work(int worker);
  // Items are left to claim and none failed.
  bool claimable() const { return next_.load() < n_ && !failed_.load(); }
  uint64_t size() const { return n_; }
  const BatchOptions& options() const { return opts_; }
  // The yield predicate says yield now (false without one).
  bool yielding() const { return opts_.should_yield && opts_.should_yield(); }
  // Threads that ran at least one item, and items run in yield mode
  // (both counted before the item runs, so its own fn sees them).
  int workers_used() const { return workers_used_.load(); }
  uint64_t yield_items() const { return yield_items_.load(); }
  // Rethrows the first exception an item threw, if any.
  void rethrow() const;

 private:
  const uint64_t n_;
  const Fn fn_;
  const BatchOptions opts_;
  std::atomic<uint64_t> next_{0};
  std::atomic<bool> failed_{false};
  std::atomic<int> runner_{-1};  // the one worker running items while yielding
  std::atomic<int> workers_used_{0};
  std::atomic<uint64_t> yield_items_{0};
  mutable std::mutex err_mu_;
  std::exception_ptr err_;
};

// Runs `batch` on the caller and up to threads-1 threads started for it (no
// more than it has items; none while it yields (BatchOptions::should_yield); fewer when
// the system refuses a thread). Returns when all have stopped; rethrows the
// first error.
void run_batch(Batch& batch, int threads);

inline void parallel_for(uint64_t n, int threads, Batch::Fn fn, BatchOptions opts = {}) {
  Batch b(n, std::move(fn), opts);
  run_batch(b, threads);
}

// Lowers the calling thread's scheduling priority (per-thread nice on Linux).
void lower_thread_priority(int nice);

class WorkerPool {
 public:
  // `nice` > 0 lowers the workers' priority (lower_thread_priority).
  WorkerPool(int threads, int nice);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // The workers run `batch` (replacing the previous one, which must be spent).
  void post(std::shared_ptr<Batch> batch);
  // Stops the workers and joins them; each finishes the batch it is in.
  void stop();
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void loop(int id);

  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Batch> cur_;
  bool stop_ = false;
  int nice_;
  std::vector<std::thread> threads_;
};

}  // namespace cudasnap
