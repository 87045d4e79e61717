// Copy engine: moves a snapshot's bytes from live state into an arena slot.
//
// Two backends behind one interface. CPU: worker threads copy host memory
// chunk by chunk, CRC32C each chunk while it is hot in cache, and the thread
// that finishes the last chunk publishes the slot. CUDA (copy_engine_cuda.cpp):
// the side stream waits on an event of the compute stream, issues one
// cudaMemcpyAsync per plan range into the registered arena, records done
// events; a completion thread checksums and publishes the slot.
//
// fence(job, phase, stream) makes a writer of the state wait for the copy:
// CPU backend: a host wait; CUDA backend: cudaStreamWaitEvent on `stream`.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "copy_plan.h"
#include "staging.h"
#include "thread_pool.h"

namespace cudasnap {

class CopyJob {
 public:
  CopyJob(int slot, int64_t step, uint64_t bytes) : slot_(slot), step_(step), bytes_(bytes) {}
  int slot() const { return slot_; }
  int64_t step() const { return step_; }
  uint64_t bytes() const { return bytes_; }
  bool done(int phase) const;
  bool failed() const;
  std::string error() const;
  // Host wait until `phase` (0 or 1) is copied; 1 also means COMPLETE. Throws
  // the job's error, if any. timeout_s < 0 waits forever; returns false on timeout.
  bool wait(int phase, double timeout_s = -1.0);
  double seconds_to_complete() const;  // submit -> COMPLETE, -1 while running
  // Abandons the job (a bounded wait ran out): it fails with `why` and its slot
  // is invalidated instead of committed. False when it is already complete or
  // being committed (its data is whole: nothing to abandon).
  bool cancel(const std::string& why);
  // Engines: called once the data is copied; false when the job was cancelled.
  bool begin_commit();

  // Used by the engines.
  void mark(int phase);
  void fail(const std::string& what);
  uint64_t submit_ns = 0;
  std::atomic<uint64_t> complete_ns{0};
  void* cuda_events[3] = {nullptr, nullptr, nullptr};  // ready, phase0, done

 private:
  int slot_;
  int64_t step_;
  uint64_t bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool phase_done_[2] = {false, false};
  bool failed_ = false;
  bool committing_ = false;
  std::string error_;
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual std::string backend() const = 0;
  // Starts copying `plan` into `slot` for `step`; returns at once. `stream` is
  // the compute stream handle (CUDA) or 0.
  virtual std::shared_ptr<CopyJob> submit(const std::shared_ptr<Arena>& arena, int slot,
                                          const std::shared_ptr<const CopyPlan>& plan,
                                          int64_t step, const SlotMeta& meta,
                                          uint64_t stream) = 0;
  // Orders `stream` (CUDA) or the calling thread (CPU) after `phase` of the
  // copy. A host wait lasts at most wait_timeout_s(); then the job is
  // cancelled (its slot never becomes COMPLETE) and false is returned.
  virtual bool fence(CopyJob& job, int phase, uint64_t stream) = 0;
  // Waits up to `timeout_s` for the running copy, then abandons it (the job
  // fails, its slot stays invalid) and stops the threads. False if abandoned.
  virtual bool shutdown(double timeout_s) = 0;
  // Bound of every internal wait: submit() for the previous copy, a host
  // fence, the completion of a CUDA copy. Default 120 s.
  double wait_timeout_s() const { return wait_s_.load(); }
  void set_wait_timeout_s(double s);

 protected:
  std::atomic<double> wait_s_{120.0};
};

// Checks shared by every engine's submit(): arena and plan present, same chunk
// size, the snapshot fits a slot. Throws StagingError naming the mismatch.
void check_submit(const std::shared_ptr<Arena>& arena, const std::shared_ptr<const CopyPlan>& plan);

// Copies one destination chunk of `plan` into `data` and returns its CRC32C.
uint32_t copy_chunk(const CopyPlan& plan, uint8_t* data, uint64_t chunk);
// CRC of chunk `chunk` of an already-filled data area.
uint32_t chunk_crc(const CopyPlan& plan, const uint8_t* data, uint64_t chunk);

class CpuCopyEngine : public CopyEngine {
 public:
  // `nice`: per-thread nice value of the workers (0 = same priority as training).
  explicit CpuCopyEngine(int threads, int nice = 10);
  ~CpuCopyEngine() override;
  std::string backend() const override { return "cpu"; }
  std::shared_ptr<CopyJob> submit(const std::shared_ptr<Arena>& arena, int slot,
                                  const std::shared_ptr<const CopyPlan>& plan, int64_t step,
                                  const SlotMeta& meta, uint64_t stream) override;
  bool fence(CopyJob& job, int phase, uint64_t stream) override;
  bool shutdown(double timeout_s) override;
  int threads() const { return pool_.size(); }
  // TEST-ONLY: every chunk copy first sleeps this long (a stalled copier; set 0
  // to release it), so tests can prove that fences wait and waits are bounded.
  void set_test_chunk_delay_us(uint64_t us) { delay_us_.store(us); }
  // Of the last finished snapshot: how many workers copied at least one chunk,
  // and how many chunks were copied in flush-yield mode (one worker, pausing
  // between chunks, while flush_active() > 0).
  int last_workers_used() const { return last_workers_.load(); }
  uint64_t last_yield_chunks() const { return last_yield_.load(); }

 private:
  struct Work;
  void copy_one(Work& w, uint64_t chunk);
  void finish_chunk(Work& w, uint64_t chunk);

  std::mutex mu_;
  std::condition_variable idle_cv_;  // current work finished
  std::shared_ptr<Work> cur_;
  bool stop_ = false;
  std::atomic<uint64_t> delay_us_{0};
  std::atomic<int> last_workers_{0};
  std::atomic<uint64_t> last_yield_{0};
  // The last plan whose ranges were all found host memory (guarded by mu_).
  std::shared_ptr<const CopyPlan> host_checked_;
  WorkerPool pool_;  // last: its workers stop before the members they use go
};

}  // namespace cudasnap
