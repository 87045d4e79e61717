#include "thread_pool.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

namespace cudasnap {

Batch::Batch(uint64_t n, Fn fn, BatchOptions opts) : n_(n), fn_(std::move(fn)), opts_(opts) {}

void Batch::work(int worker) {
  bool counted = false;
  for (;;) {
    if (failed_.load()) break;
    bool solo = false;
    if (yielding()) {
      int expect = -1;
      if (!runner_.compare_exchange_strong(expect, worker) && expect != worker) {
        if (next_.load() >= n_) break;
        std::this_thread::sleep_for(std::chrono::microseconds(500));
        continue;
      }
      solo = true;
    } else if (runner_.load() == worker) {
      runner_.store(-1);
    }
    uint64_t i = next_.fetch_add(1);
    if (i >= n_) break;
    if (!counted) {
      counted = true;
      workers_used_.fetch_add(1);
    }
    if (solo) yield_items_.fetch_add(1);
    try {
      fn_(i);
    } catch (...) {
      std::lock_guard<std::mutex> g(err_mu_);
      if (!err_) err_ = std::current_exception();
      failed_.store(true);
    }
    if (solo && opts_.yield_pause_us)
      std::this_thread::sleep_for(std::chrono::microseconds(opts_.yield_pause_us));
  }
  int me = worker;
  runner_.compare_exchange_strong(me, -1);
}

void Batch::rethrow() const {
  std::lock_guard<std::mutex> g(err_mu_);
  if (err_) std::rethrow_exception(err_);
}

void run_batch(Batch& batch, int threads) {
  uint64_t t = std::min<uint64_t>(uint64_t(std::max(threads, 1)), std::max<uint64_t>(batch.size(), 1));
  if (batch.yielding()) t = 1;
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  try {
    for (uint64_t k = 1; k < t; ++k) pool.emplace_back([&batch, k] { batch.work(int(k)); });
  } catch (...) {  // no more threads to be had: the others (at least the caller) finish
  }
  batch.work(0);
  for (auto& th : pool) th.join();
  batch.rethrow();
}

void lower_thread_priority(int nice) {
  // Snapshot copies use spare cycles and never preempt the training thread on
  // a busy host. Per-thread nice alone does not do that: a nice-10 worker woken
  // by submit() still preempts the trainer (wake-up preemption), which then
  // waits on the run queue while the worker copies (6-10 ms of a 0.1 ms
  // submit() at 40,000 tensors on a loaded 2-core VM). SCHED_BATCH threads never
  // preempt on wake-up yet keep their nice-10 share of the CPU (SCHED_IDLE could
  // be starved by a busy host, and a fence would then wait on it). Both calls
  // only lower this thread's priority (no privilege needed); failure is harmless.
  if (nice <= 0) return;
  const pid_t tid = static_cast<pid_t>(syscall(SYS_gettid));
#ifdef SCHED_BATCH
  sched_param sp{};
  sp.sched_priority = 0;
  (void)sched_setscheduler(tid, SCHED_BATCH, &sp);  // keeps the nice value
#endif
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice);
}

WorkerPool::WorkerPool(int threads, int nice) : nice_(nice) {
  threads_.reserve(threads);
  try {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this, i] { loop(i); });
  } catch (...) {
    stop();
    throw;
  }
}

WorkerPool::~WorkerPool() { stop(); }

void WorkerPool::post(std::shared_ptr<Batch> batch) {
  {
    std::lock_guard<std::mutex> g(mu_);
    cur_ = std::move(batch);
  }
  cv_.notify_all();
}

void WorkerPool::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
}

void WorkerPool::loop(int id) {
  lower_thread_priority(nice_);
  for (;;) {
    std::shared_ptr<Batch> b;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || (cur_ && cur_->claimable()); });
      if (stop_) return;
      b = cur_;
    }
    b->work(id);
  }
}

}  // namespace cudasnap
