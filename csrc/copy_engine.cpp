#include "copy_engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "crc32c.h"
#include "error.h"
#include "flusher.h"

namespace cudasnap {

// ---------------------------------------------------------------- CopyJob

bool CopyJob::done(int phase) const {
  std::lock_guard<std::mutex> g(mu_);
  return phase_done_[phase ? 1 : 0] || failed_;
}

bool CopyJob::failed() const {
  std::lock_guard<std::mutex> g(mu_);
  return failed_;
}

std::string CopyJob::error() const {
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}

bool CopyJob::wait(int phase, double timeout_s) {
  CUDASNAP_CHECK(phase == 0 || phase == 1, "phase must be 0 or 1, got " << phase);
  std::unique_lock<std::mutex> lk(mu_);
  auto ready = [&] { return phase_done_[phase] || failed_; };
  if (timeout_s < 0) {
    cv_.wait(lk, ready);
  } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready)) {
    return false;
  }
  if (failed_)
    CUDASNAP_CHECK_KIND(ErrorKind::Staging, false,
                        "snapshot copy of step " << step_ << " failed: " << error_);
  return true;
}

bool CopyJob::cancel(const std::string& why) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (committing_ || phase_done_[1] || failed_) return false;
    failed_ = true;
    error_ = why;
  }
  cv_.notify_all();
  return true;
}

bool CopyJob::begin_commit() {
  std::lock_guard<std::mutex> g(mu_);
  if (failed_) return false;
  committing_ = true;
  return true;
}

void CopyEngine::set_wait_timeout_s(double s) {
  CUDASNAP_CHECK(s > 0, "wait timeout must be > 0 seconds, got " << s);
  wait_s_.store(s);
}

double CopyJob::seconds_to_complete() const {
  uint64_t c = complete_ns.load();
  return c ? (c - submit_ns) * 1e-9 : -1.0;
}

void CopyJob::mark(int phase) {
  {
    std::lock_guard<std::mutex> g(mu_);
    phase_done_[0] = true;
    if (phase == 1) phase_done_[1] = true;
  }
  if (phase == 1) complete_ns.store(monotonic_ns());
  cv_.notify_all();
}

void CopyJob::fail(const std::string& what) {
  {
    std::lock_guard<std::mutex> g(mu_);
    failed_ = true;
    error_ = what;
  }
  cv_.notify_all();
}

// ------------------------------------------------------------ chunk copy

namespace {
// First range whose end lies beyond `lo` (ranges are sorted by dst).
size_t first_range(const CopyPlan& plan, uint64_t lo) {
  auto it = std::upper_bound(plan.ranges.begin(), plan.ranges.end(), lo,
                             [](uint64_t v, const PlanRange& r) { return v < r.dst + r.nbytes; });
  return static_cast<size_t>(it - plan.ranges.begin());
}
}  // namespace

void check_submit(const std::shared_ptr<Arena>& arena, const std::shared_ptr<const CopyPlan>& plan) {
  CUDASNAP_CHECK(arena && plan, "submit needs an arena and a plan");
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, plan->chunk_bytes == arena->chunk_bytes(),
                      "plan chunk size " << plan->chunk_bytes << " differs from the arena's "
                                         << arena->chunk_bytes());
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, plan->total_bytes <= arena->data_capacity(),
                      "snapshot needs " << plan->total_bytes << " bytes, arena slots hold "
                                        << arena->data_capacity());
}

uint32_t copy_chunk(const CopyPlan& plan, uint8_t* data, uint64_t chunk) {
  uint64_t lo = chunk * plan.chunk_bytes;
  uint64_t hi = std::min(lo + plan.chunk_bytes, plan.total_bytes);
  uint64_t cursor = lo;
  uint32_t crc = 0;  // continued range by range, in slot order: the chunk's CRC32C
  for (size_t i = first_range(plan, lo); i < plan.ranges.size(); ++i) {
    const PlanRange& r = plan.ranges[i];
    if (r.dst >= hi) break;
    uint64_t s = std::max(lo, r.dst);
    uint64_t e = std::min(hi, r.dst + r.nbytes);
    if (s > cursor) {  // alignment padding
      std::memset(data + cursor, 0, s - cursor);
      crc = crc32c(crc, data + cursor, s - cursor);
    }
    // One read of the source for the copy and its checksum.
    crc = crc32c_copy(crc, data + s, reinterpret_cast<const uint8_t*>(r.src) + (s - r.dst), e - s);
    cursor = e;
  }
  if (cursor < hi) {
    std::memset(data + cursor, 0, hi - cursor);
    crc = crc32c(crc, data + cursor, hi - cursor);
  }
  return crc;
}

uint32_t chunk_crc(const CopyPlan& plan, const uint8_t* data, uint64_t chunk) {
  uint64_t lo = chunk * plan.chunk_bytes;
  uint64_t hi = std::min(lo + plan.chunk_bytes, plan.total_bytes);
  return crc32c(0, data + lo, hi - lo);
}

// --------------------------------------------------------- CpuCopyEngine

struct CpuCopyEngine::Work {
  std::shared_ptr<CopyJob> job;
  std::shared_ptr<Arena> arena;
  std::shared_ptr<const CopyPlan> plan;
  uint8_t* data = nullptr;
  uint32_t* table = nullptr;
  uint64_t nchunks = 0;
  uint64_t p0chunks = 0;
  std::atomic<uint64_t> done{0};
  std::atomic<uint64_t> p0done{0};
  std::atomic<bool> failed{false};
  const Batch* batch = nullptr;  // runs the chunks; outlives every chunk's call
};

namespace {
int checked_threads(int threads, int nice) {
  CUDASNAP_CHECK(threads >= 1 && threads <= 256, "copy threads must be 1..256, got " << threads);
  CUDASNAP_CHECK(nice >= 0 && nice <= 19, "copy thread nice value must be 0..19, got " << nice);
  return threads;
}
}  // namespace

CpuCopyEngine::CpuCopyEngine(int threads, int nice) : pool_(checked_threads(threads, nice), nice) {}

CpuCopyEngine::~CpuCopyEngine() {
  try {
    shutdown(wait_timeout_s());
  } catch (...) {
  }
}

bool CpuCopyEngine::shutdown(double timeout_s) {
  bool clean = true;
  std::shared_ptr<Work> left;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (stop_) return true;
    // Let the running snapshot finish, for a bounded time.
    clean = idle_cv_.wait_for(lk, std::chrono::duration<double>(std::max(0.0, timeout_s)),
                              [&] { return !cur_; });
    if (!clean) {
      left = cur_;
      left->job->cancel("snapshot copy abandoned: the copy engine was shut down after waiting " +
                        std::to_string(timeout_s) + " s for it");
      left->failed.store(true);
    }
    stop_ = true;
  }
  idle_cv_.notify_all();
  // Workers finish the batch they are in: cancelled chunks are skipped, only counted.
  pool_.stop();
  if (left && left->arena) {  // no worker finished it (null once a worker did)
    try {
      left->arena->invalidate(left->job->slot());
    } catch (...) {
    }
  }
  return clean;
}

std::shared_ptr<CopyJob> CpuCopyEngine::submit(const std::shared_ptr<Arena>& arena, int slot,
                                               const std::shared_ptr<const CopyPlan>& plan,
                                               int64_t step, const SlotMeta& meta,
                                               uint64_t /*stream*/) {
  check_submit(arena, plan);
  auto work = std::make_shared<Work>();
  work->job = std::make_shared<CopyJob>(slot, step, plan->total_bytes);
  work->job->submit_ns = monotonic_ns();
  work->arena = arena;
  work->plan = plan;
  work->data = arena->data(slot);
  work->table = arena->table(slot);
  work->nchunks = plan->num_chunks();
  work->p0chunks = plan->phase0_chunks();
  {
    std::unique_lock<std::mutex> lk(mu_);
    CUDASNAP_CHECK(!stop_, "copy engine is shut down");
    // O(ranges) once per plan, not per boundary: a plan is immutable once built.
    if (plan != host_checked_) {
      for (const PlanRange& r : plan->ranges)
        CUDASNAP_CHECK(r.host, "the CPU copy engine cannot read device memory (range at 0x"
                                   << std::hex << r.src << "); use the CUDA backend");
      host_checked_ = plan;
    }
    // One snapshot in flight at a time; a stalled one must not hang the trainer.
    double wait_s = wait_timeout_s();
    bool idle = idle_cv_.wait_for(lk, std::chrono::duration<double>(wait_s),
                                  [&] { return !cur_ || stop_; });
    CUDASNAP_CHECK(!stop_, "copy engine is shut down");
    CUDASNAP_CHECK_KIND(ErrorKind::Staging, idle,
                        "the previous snapshot (step " << cur_->job->step()
                            << ") is still copying after " << wait_s << " s");
    arena->begin_write(slot, step, meta);
    if (work->nchunks == 0) {
      arena->commit(slot, step, 0);
      work->job->mark(1);
      return work->job;
    }
    if (work->p0chunks == 0) work->job->mark(0);
    cur_ = work;
    // Flush-yield: while a flush runs, one worker copies, pausing between chunks.
    auto batch = std::make_shared<Batch>(
        work->nchunks, [this, work](uint64_t c) { copy_one(*work, c); },
        BatchOptions{/*should_yield=*/flush_running, /*yield_pause_us=*/100});
    work->batch = batch.get();
    pool_.post(std::move(batch));
  }
  return work->job;
}

bool CpuCopyEngine::fence(CopyJob& job, int phase, uint64_t /*stream*/) {
  double wait_s = wait_timeout_s();
  if (job.wait(phase, wait_s)) return true;
  if (job.cancel("snapshot copy abandoned: a fence waited " + std::to_string(wait_s) +
                 " s for phase " + std::to_string(phase) + " (copier stalled)"))
    return false;
  return job.wait(phase, wait_s);  // it was committing: done in a moment
}

void CpuCopyEngine::copy_one(Work& w, uint64_t c) {
  // TEST-ONLY stall; re-read each millisecond, so a test releases it by setting 0.
  for (uint64_t slept = 0; delay_us_.load() > slept && !w.job->failed(); slept += 1000)
    std::this_thread::sleep_for(std::chrono::microseconds(1000));
  if (!w.failed.load() && !w.job->failed()) {
    try {
      w.table[c] = copy_chunk(*w.plan, w.data, c);
    } catch (const std::exception& e) {
      w.failed.store(true);
      w.job->fail(e.what());
    }
  }
  finish_chunk(w, c);
}

void CpuCopyEngine::finish_chunk(Work& w, uint64_t chunk) {
  if (chunk < w.p0chunks && w.p0done.fetch_add(1) + 1 == w.p0chunks) w.job->mark(0);
  if (w.done.fetch_add(1) + 1 != w.nchunks) return;
  bool ok = !w.failed.load() && w.job->begin_commit();
  std::string err;
  if (ok) {
    try {
      w.arena->commit(w.job->slot(), w.job->step(), w.plan->total_bytes);
    } catch (const std::exception& e) {
      ok = false;
      err = e.what();
    }
  } else {
    w.arena->invalidate(w.job->slot());
  }
  // Drop the engine's reference before the job is marked: a trainer that then
  // replaces the arena (regrowth) must be able to unmap it at once.
  w.arena.reset();
  // Become idle BEFORE waking the trainer: the workers run at a lower priority,
  // and a trainer that wakes first would otherwise wait in its next submit()
  // for this thread to be scheduled again on a busy host.
  std::shared_ptr<CopyJob> job = w.job;
  last_workers_.store(w.batch->workers_used());
  last_yield_.store(w.batch->yield_items());
  {
    std::lock_guard<std::mutex> g(mu_);
    cur_.reset();
  }
  idle_cv_.notify_all();
  if (ok) {
    job->mark(1);
  } else if (!err.empty()) {
    job->fail(err);
  }
}

}  // namespace cudasnap
