// CUDA copy engine: snapshot D2H copies on a side stream, never blocking the trainer.
//
// submit(): record `ready` on the compute stream; the copy stream waits on it
// (no host sync), issues one cudaMemcpyAsync per phase-0 device range, records
// `phase0`, issues the phase-1 ranges, records `done`, and returns. Host
// ranges (tiny host state) are memcpy'd synchronously in submit(). A
// completion thread (never the trainer) waits for phase0, marks phase 0,
// CRCs the chunks wholly inside the phase-0 region, waits for done, CRCs the
// rest (several threads for large snapshots), commits the slot and marks the
// job complete. On a CUDA error the job fails and the slot is invalidated, so
// the previous COMPLETE slot stays the newest.
//
// fence(job, phase, stream): cudaStreamWaitEvent(stream, phase0 or done); no
// host block; a no-op once that phase is done. While `stream` is capturing a
// CUDA graph the fence is a host wait instead (an event wait from outside the
// capture would invalidate it); submit() refuses a capturing compute stream
// with a StagingError (the Snapshotter skips that step and counts it). The
// legacy default stream counts as capturing while a blocking stream of its
// device captures (cudaStreamIsCapturing: cudaErrorStreamCaptureImplicit).
//
// Stream capture: the completion thread runs in relaxed capture mode, and the
// engine's other potentially unsafe calls (cudaHostAlloc/cudaFreeHost of the
// gather descriptors, event queries on an aborted submit) are made in relaxed
// mode too (capture_mode.h): none of them invalidates a graph capture the
// trainer runs meanwhile.
//
// Every host wait is bounded by wait_timeout_s(): the completion thread polls
// its events (cudaEventQuery) against a deadline instead of blocking in
// cudaEventSynchronize, so a hung or lost GPU fails the job and never hangs
// close(), __exit__ or an atexit handler.
//
// One snapshot is in flight at a time: submit() waits (host, bounded) for the
// previous one to finish. Events come from a ring of two triples, never destroyed
// before shutdown(), so a fence racing the next submit waits on a valid
// (newer, hence stricter) event.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "../copy_engine.h"
#include "copy_wake.h"
#include "gather.h"

namespace cudasnap {

class CudaCopyEngine : public CopyEngine {
 public:
  // gather_small: copy device ranges < gather_max_bytes with one gather-kernel
  // launch per phase into the mapped arena (needs a Mapped registration).
  CudaCopyEngine(int device, int crc_threads, bool gather_small = false,
                 uint64_t gather_max_bytes = 64 * 1024);
  ~CudaCopyEngine() override;
  std::string backend() const override { return "cuda"; }
  std::shared_ptr<CopyJob> submit(const std::shared_ptr<Arena>& arena, int slot,
                                  const std::shared_ptr<const CopyPlan>& plan, int64_t step,
                                  const SlotMeta& meta, uint64_t stream) override;
  bool fence(CopyJob& job, int phase, uint64_t stream) override;
  bool shutdown(double timeout_s) override;

  int device() const { return device_; }
  int crc_threads() const { return crc_threads_; }
  bool gather_small() const { return gather_small_; }
  uint64_t gather_max_bytes() const { return gather_max_; }
  bool busy() const;
  // A copy did not complete within wait_timeout_s() (GPU hung or lost): the
  // job was failed, and shutdown() skips calls that could block on the device.
  bool hung() const { return hung_.load(); }
  // TEST-ONLY: a host function sleeping this long runs on the copy stream
  // before each snapshot's copies (tests/cuda/test_gpu_e2e.py): the copy then
  // certainly overlaps the next step, so a missing fence is always caught.
  void set_test_copy_delay_us(uint64_t us) { test_delay_us_.store(us); }
  uint64_t copy_stream() const { return reinterpret_cast<uint64_t>(copy_stream_); }
  // Snapshot-then-offload: a device buffer (`ptr`, `bytes`; on this engine's device,
  // owned by the caller, e.g. a tensor from torch's caching allocator) takes the first
  // `bytes` of each snapshot's data area by a device-to-device copy; the rest is copied
  // to the host directly. The fences (phase 0 / done) wait only for those copies; the
  // staged part then drains to the host on the copy stream, and the snapshot is
  // COMPLETE once it has landed and is checksummed. Waits (bounded) for the running
  // copy first, so the caller may free the old buffer when it returns; 0, 0: off.
  void set_device_staging(uint64_t ptr, uint64_t bytes);
  uint64_t device_staging_bytes() const;
  // Bytes of the last submitted snapshot staged on the device (0: copied directly).
  uint64_t last_staged() const { return last_staged_.load(); }
  // Whether copies go out as one cudaMemcpyBatchAsync per stretch between progress marks
  // (CUDA 12.8+ runtime and driver); once refused, one cudaMemcpyAsync each, and
  // batch_refusal() is the cudaError_t that refused it (0: never refused).
  bool batched() const { return batch_ok_.load(); }
  int batch_refusal() const { return batch_refusal_.load(); }
  // Counters of the last submitted snapshot: cudaMemcpyAsync calls, gathered ranges.
  uint64_t last_memcpy_calls() const { return last_memcpy_.load(); }
  uint64_t last_gathered() const { return last_gathered_.load(); }

 private:
  static constexpr int kRing = 2;
  // A region of chunks [c0, c1) whose bytes have all landed once `ev` completes;
  // the completion thread checksums the regions in this order.
  struct Seg {
    cudaEvent_t ev;
    uint64_t c0, c1;
    bool phase0;  // `ev` is the phase-0 event: the job reaches phase 0 there
  };
  struct Work {
    std::shared_ptr<CopyJob> job;
    std::shared_ptr<Arena> arena;
    std::shared_ptr<const CopyPlan> plan;
    int slot = -1;
    int ring = 0;
    std::vector<std::pair<uint64_t, uint64_t>> pads;  // [lo, hi) of the data area to zero
    // Checksum order: the CRC of each region runs while later ones still copy.
    std::vector<Seg> segs;
    cudaEvent_t last = nullptr;  // the snapshot's last copy event (done, or landed)
  };
  // The pieces of submit(), in its order. The compute stream: on this device, not capturing.
  void check_compute_stream(cudaStream_t compute, uint64_t stream);
  // Waits (bounded) until no snapshot is in flight, marks one in flight; returns its event
  // ring and sets *staged (bytes of it to stage on the device).
  int claim_ring(uint64_t total_bytes, uint64_t* staged);
  void not_in_flight();  // the in-flight snapshot is over (finished, failed or given up)
  // Room for `ngather` gather descriptors in `ring`'s mapped buffer.
  void reserve_gather_descs(int ring, uint64_t ngather);
  std::shared_ptr<Work> new_work(const std::shared_ptr<CopyJob>& job,
                                 const std::shared_ptr<Arena>& arena,
                                 const std::shared_ptr<const CopyPlan>& plan, int slot, int ring);
  // On the copy stream, behind the compute stream's ready event: the phase-0 copies, the
  // phase0 event, the phase-1 copies, the done event, then (device staging) the drain to
  // the host and the landed event. Returns the progress marks recorded.
  std::vector<std::pair<int, uint64_t>> issue_copies(const CopyPlan& plan, cudaStream_t compute,
                                                     uint8_t* data, uint64_t data_dev, int ring,
                                                     uint64_t staged);
  // `w`'s checksum regions, in the order their bytes land.
  void add_segments(Work& w, const CopyPlan& plan, int ring, uint64_t staged,
                    const std::vector<std::pair<int, uint64_t>>& marks);
  // A submit() that threw: waits (bounded) for copies issued, invalidates a begun slot.
  void abort_submit(Arena& arena, int slot, bool issued, bool began);
  void completion_loop();
  void finish(Work& w);
  void crc_chunks(const CopyPlan& plan, const uint8_t* data, uint32_t* table, uint64_t c0,
                  uint64_t c1);
  // Issues `phase`'s device ranges; with `marks`, also records progress events
  // (at most kMarks, one per ~1/(kMarks+1) of the data) between them.
  // Bytes below `staged` go to the device staging buffer instead (no marks then).
  void issue(const CopyPlan& plan, int phase, uint8_t* data, uint64_t data_dev, int ring,
             uint64_t& desc_used, std::vector<std::pair<int, uint64_t>>* marks = nullptr,
             uint64_t staged = 0);
  // Copies the staged [0, staged) of the data area from the device buffer to `data`,
  // in pieces with progress marks between them.
  void drain(const CopyPlan& plan, uint64_t staged, uint8_t* data, int ring,
             std::vector<std::pair<int, uint64_t>>* marks);
  // The copies between two progress marks, submitted together by flush_batch().
  struct CopyBatch {
    std::vector<void*> dst;
    std::vector<const void*> src;
    std::vector<size_t> n;
    std::vector<cudaMemcpyKind> kind;  // for the one-by-one fallback
    void add(void* d, const void* s, size_t bytes, cudaMemcpyKind k) {
      dst.push_back(d);
      src.push_back(s);
      n.push_back(bytes);
      kind.push_back(k);
    }
    void clear() {
      dst.clear();
      src.clear();
      n.clear();
      kind.clear();
    }
  };
  // One cudaMemcpyBatchAsync for `b` where the runtime and driver take it, else one
  // cudaMemcpyAsync per copy; adds the API calls made to `calls`; empties `b`.
  void flush_batch(CopyBatch& b, uint64_t& calls);
  void release_cuda() noexcept;
  // Polls `ev` until it completes; throws on a CUDA error, on `deadline_ns`
  // (monotonic) passing (sets hung_) or when shutdown() abandons the copy.
  void wait_event(cudaEvent_t ev, uint64_t deadline_ns, const char* what);
  // Whether `ev` has completed (cudaEventQuery; throws on a CUDA error).
  static bool event_done(cudaEvent_t ev);

  int device_;
  int crc_threads_;
  bool gather_small_;
  uint64_t gather_max_;
  cudaStream_t copy_stream_ = nullptr;
  static constexpr int kMarks = 16;
  cudaEvent_t ev_[kRing][4] = {};  // ready, phase0, done, landed (device staging)
  cudaEvent_t ev_mark_[kRing][kMarks] = {};  // phase-1 progress (checksums as chunks land)
  GatherDesc* desc_[kRing] = {};   // mapped pinned descriptor buffers (gather only)
  uint64_t desc_cap_[kRing] = {};
  int ring_next_ = 0;
  std::atomic<uint64_t> last_memcpy_{0};
  std::atomic<uint64_t> last_gathered_{0};
  std::atomic<uint64_t> last_staged_{0};
#if CUDART_VERSION >= 12080
  std::atomic<bool> batch_ok_{true};
#else
  std::atomic<bool> batch_ok_{false};  // built against a runtime without the batch API
#endif
  std::atomic<int> batch_refusal_{0};
  uint64_t staging_ptr_ = 0;  // device staging buffer (guarded by mu_; changed only when idle)
  uint64_t staging_bytes_ = 0;
  std::atomic<bool> hung_{false};
  std::atomic<bool> abandon_{false};
  std::atomic<uint64_t> test_delay_us_{0};
  std::shared_ptr<CopyWake> wake_ = std::make_shared<CopyWake>();

  mutable std::mutex mu_;
  std::condition_variable cv_;       // work for the completion thread / stop
  std::condition_variable idle_cv_;  // the in-flight snapshot finished
  std::shared_ptr<Work> pending_;
  bool in_flight_ = false;
  bool stop_ = false;
  bool shut_ = false;
  std::thread completion_;
};

}  // namespace cudasnap
