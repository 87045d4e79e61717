#include "copy_engine_cuda.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <sstream>
#include <thread>

#include "../error.h"
#include "../flusher.h"
#include "../thread_pool.h"
#include "capture_mode.h"
#include "cuda_backend.h"
#include "device_guard.h"

namespace cudasnap {

namespace {

// A checksum batch smaller than this runs on one thread (the pool's hand-off costs
// more); larger ones use every CRC thread: the host CRC must keep pace with a
// ~50 GB/s DMA, which one core (~10-20 GB/s) cannot.
constexpr uint64_t kParallelCrcBytes = 4ull << 20;

uint64_t deadline_after(double seconds) {
  return monotonic_ns() + static_cast<uint64_t>(std::max(0.0, seconds) * 1e9);
}

// TEST-ONLY delay on the copy stream (set_test_copy_delay_us). A host function
// makes no CUDA call, as cudaLaunchHostFunc requires.
void CUDART_CB sleep_host_fn(void* us) {
  std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<uintptr_t>(us)));
}

// Whether `s` (0: the legacy default stream of the current device) is capturing
// a CUDA graph. The legacy stream answers cudaErrorStreamCaptureImplicit while
// a blocking stream of its device captures (work on it would join that
// capture): that counts as capturing too; `*implicit` says which.
bool stream_capturing(cudaStream_t s, bool* implicit) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  cudaError_t st = cudaStreamIsCapturing(s, &cap);
  *implicit = st == cudaErrorStreamCaptureImplicit;
  if (*implicit) {
    (void)cudaGetLastError();  // not sticky: clear it, torch would report it later
    return true;
  }
  CUDASNAP_CUDA_CHECK(st);
  return cap != cudaStreamCaptureStatusNone;  // Active, or Invalidated (not yet ended)
}

}  // namespace

// ------------------------------------------------------------ lifecycle

CudaCopyEngine::CudaCopyEngine(int device, int crc_threads, bool gather_small,
                               uint64_t gather_max_bytes)
    : device_(device),
      crc_threads_(crc_threads),
      gather_small_(gather_small),
      gather_max_(gather_max_bytes) {
  CUDASNAP_CHECK(crc_threads >= 1 && crc_threads <= 256,
                 "crc threads must be 1..256, got " << crc_threads);
  int count = 0;
  CUDASNAP_CUDA_CHECK(cudaGetDeviceCount(&count));
  CUDASNAP_CHECK_KIND(ErrorKind::Cuda, device >= 0 && device < count,
                      "CudaCopyEngine: device " << device << " out of range (" << count
                                                << " CUDA devices visible)");
  try {
    DeviceGuard g(device_);
    CaptureModeGuard relaxed;  // the trainer may build the engine while another thread captures
    CUDASNAP_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    for (int r = 0; r < kRing; ++r) {
      CUDASNAP_CUDA_CHECK(cudaEventCreateWithFlags(&ev_[r][0], cudaEventDisableTiming));
      for (int k = 1; k < 4; ++k)  // waited on by the completion thread: sleep, do not spin
        CUDASNAP_CUDA_CHECK(cudaEventCreateWithFlags(
            &ev_[r][k], cudaEventDisableTiming | cudaEventBlockingSync));
      for (int k = 0; k < kMarks; ++k)
        CUDASNAP_CUDA_CHECK(cudaEventCreateWithFlags(&ev_mark_[r][k], cudaEventDisableTiming));
    }
    // The completion thread polls events (cudaEventQuery) while the trainer may
    // capture a CUDA graph: it runs in relaxed capture mode, or every poll
    // during a Global-mode capture would invalidate that capture.
    std::promise<cudaError_t> mode_set;
    std::future<cudaError_t> mode_status = mode_set.get_future();
    completion_ = std::thread([this, &mode_set] {
      // This device first: the thread's first runtime call would otherwise make a
      // context on device 0 (a new thread's current device).
      if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      cudaError_t st = cudaThreadExchangeStreamCaptureMode(&mode);
      if (st != cudaSuccess) (void)cudaGetLastError();
      mode_set.set_value(st);
      if (st == cudaSuccess) completion_loop();
    });
    cudaError_t st = mode_status.get();
    if (st != cudaSuccess) {
      completion_.join();
      CUDASNAP_CUDA_CHECK(st);
    }
  } catch (...) {
    release_cuda();
    throw;
  }
}

CudaCopyEngine::~CudaCopyEngine() {
  try {
    shutdown(wait_timeout_s());
  } catch (...) {
  }
}

void CudaCopyEngine::release_cuda() noexcept {
  // At interpreter exit the runtime may already be unloading: ignore errors.
  CaptureModeGuard relaxed(CaptureModeGuard::NoThrow{});  // cudaFreeHost: see capture_mode.h
  DeviceGuard dev(device_, DeviceGuard::NoThrow{});
  const bool hung = hung_.load();
  for (int r = 0; r < kRing; ++r) {
    // Event and stream destruction return at once even with work pending.
    for (int k = 0; k < 4; ++k) {
      if (ev_[r][k]) (void)cudaEventDestroy(ev_[r][k]);
      ev_[r][k] = nullptr;
    }
    for (int k = 0; k < kMarks; ++k) {
      if (ev_mark_[r][k]) (void)cudaEventDestroy(ev_mark_[r][k]);
      ev_mark_[r][k] = nullptr;
    }
    // cudaFreeHost may synchronize with the device: on a hung GPU leak the
    // (small) descriptor buffers rather than hang the process's exit.
    if (desc_[r] && !hung) (void)cudaFreeHost(desc_[r]);
    desc_[r] = nullptr;
    desc_cap_[r] = 0;
  }
  if (copy_stream_) (void)cudaStreamDestroy(copy_stream_);
  copy_stream_ = nullptr;
  (void)cudaGetLastError();
}

bool CudaCopyEngine::shutdown(double timeout_s) {
  bool clean = true;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (shut_) return true;
    // Let the running snapshot finish, for a bounded time; then the completion
    // thread (polling its events) abandons it: the job fails, the slot stays
    // invalid.
    clean = idle_cv_.wait_for(lk, std::chrono::duration<double>(std::max(0.0, timeout_s)),
                              [&] { return !in_flight_; });
    if (!clean) {
      abandon_.store(true);
      hung_.store(true);
    }
    shut_ = true;
    stop_ = true;
  }
  cv_.notify_all();
  idle_cv_.notify_all();  // a submit() waiting for its turn fails cleanly
  if (completion_.joinable()) completion_.join();  // bounded: it polls abandon_
  release_cuda();
  return clean;
}

void CudaCopyEngine::wait_event(cudaEvent_t ev, uint64_t deadline_ns, const char* what) {
  uint64_t sleep_us = 20;
  for (;;) {
    const uint64_t gen = wake_->generation();
    cudaError_t st = cudaEventQuery(ev);
    if (st == cudaSuccess) return;
    if (st != cudaErrorNotReady) CUDASNAP_CUDA_CHECK(st);
    (void)cudaGetLastError();  // cudaErrorNotReady is recorded as the last error too
    CUDASNAP_CHECK_KIND(ErrorKind::Cuda, !abandon_.load(),
                        "copy abandoned while waiting for " << what
                                                            << ": the engine was shut down");
    if (monotonic_ns() > deadline_ns) {
      hung_.store(true);
      CUDASNAP_CHECK_KIND(ErrorKind::Cuda, false,
                          what << " did not complete within " << wait_timeout_s()
                               << " s: the GPU is hung or lost");
    }
    wake_->wait_for(gen, sleep_us);  // returns early when the copy stream's wake runs
    // At most 100 us between polls: each late poll delays the checksums behind this
    // event and COMPLETE (timing model, h200: boundary -> COMPLETE over the DMA time at
    // 256 MiB 1.27-1.34 with a 1 ms cap, 1.16-1.19 with this one; ~1% of a core while
    // a copy runs).
    sleep_us = std::min<uint64_t>(sleep_us * 2, 100);
  }
}

bool CudaCopyEngine::event_done(cudaEvent_t ev) {
  cudaError_t st = cudaEventQuery(ev);
  if (st == cudaSuccess) return true;
  if (st != cudaErrorNotReady) CUDASNAP_CUDA_CHECK(st);
  (void)cudaGetLastError();  // cudaErrorNotReady is recorded as the last error too
  return false;
}

bool CudaCopyEngine::busy() const {
  std::lock_guard<std::mutex> g(mu_);
  return in_flight_;
}

// --------------------------------------------------------------- submit

void CudaCopyEngine::flush_batch(CopyBatch& b, uint64_t& calls) {
  if (b.n.empty()) return;
#if CUDART_VERSION >= 12080
  if (b.n.size() > 1 && batch_ok_.load()) {
    cudaMemcpyAttributes attr{};  // location hints: ignored for memory that is not managed
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // the sources are read in order
    size_t first = 0;
#if CUDART_VERSION >= 13000
    cudaError_t st = cudaMemcpyBatchAsync(b.dst.data(), b.src.data(), b.n.data(), b.n.size(),
                                          &attr, &first, 1, copy_stream_);
#else
    size_t fail = 0;
    cudaError_t st = cudaMemcpyBatchAsync(b.dst.data(), const_cast<void**>(b.src.data()),
                                          b.n.data(), b.n.size(), &attr, &first, 1, &fail,
                                          copy_stream_);
#endif
    if (st == cudaSuccess) {
      ++calls;
      b.clear();
      return;
    }
    // A runtime or driver without it (or refusing these attributes) refuses the whole
    // batch before queuing a copy: one cudaMemcpyAsync each from now on.
    if (st != cudaErrorNotSupported && st != cudaErrorCallRequiresNewerDriver &&
        st != cudaErrorInvalidValue)
      CUDASNAP_CUDA_CHECK(st);
    (void)cudaGetLastError();
    batch_ok_.store(false);
    batch_refusal_.store(static_cast<int>(st));
  }
#endif
  for (size_t i = 0; i < b.n.size(); ++i) {
    CUDASNAP_CUDA_CHECK(cudaMemcpyAsync(b.dst[i], b.src[i], b.n[i], b.kind[i], copy_stream_));
    ++calls;
  }
  b.clear();
}

void CudaCopyEngine::issue(const CopyPlan& plan, int phase, uint8_t* data, uint64_t data_dev,
                           int ring, uint64_t& desc_used,
                           std::vector<std::pair<int, uint64_t>>* marks, uint64_t staged) {
  uint64_t first_desc = desc_used;
  uint64_t memcpys = 0, gathered = 0;
  CopyBatch batch;  // the copies up to the next mark: one submission (flush_batch)
  // Small ranges go to one gather kernel per group, launched before the group's mark.
  auto launch_pending = [&] {
    flush_batch(batch, memcpys);
    uint64_t n = desc_used - first_desc;
    if (!n) return;
    GatherDesc* dev_desc = nullptr;
    CUDASNAP_CUDA_CHECK(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_desc), desc_[ring], 0));
    CUDASNAP_CUDA_CHECK(launch_gather(dev_desc + first_desc, static_cast<int>(n), copy_stream_));
    gathered += n;
    first_desc = desc_used;
  };
  // Ranges are sorted by dst, host ranges are written at submit and phase 0 completes
  // before phase 1 starts (same stream): once every byte issued before a mark has
  // landed, every byte of the data area below the mark's offset has. A mark there
  // lets the completion thread checksum those chunks while the DMA goes on. Marks
  // fall on chunk boundaries about 1/(kMarks+1) of the data apart; a range that
  // spans one is copied in two pieces, so one large tensor does not leave its
  // whole checksum to after the copy.
  const uint64_t cb = plan.chunk_bytes;
  const uint64_t group = std::max<uint64_t>(1, (plan.total_bytes / (kMarks + 1) + cb - 1) / cb) * cb;
  uint64_t next_mark = (plan.phase0_bytes / cb) * cb + group;
  auto mark_at = [&](uint64_t off) {
    launch_pending();
    int k = static_cast<int>(marks->size());
    CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_mark_[ring][k], copy_stream_));
    marks->emplace_back(k, off / cb);
    next_mark = (off / cb) * cb + group;
  };
  auto room = [&] { return marks && marks->size() < size_t(kMarks); };
  for (const PlanRange& r : plan.ranges) {
    if (r.host || r.phase != phase || r.nbytes == 0) continue;
    const bool small = gather_small_ && r.nbytes < gather_max_;
    uint64_t off = 0;  // bytes of r issued so far
    if (r.dst < staged) {  // its staged part: device to device, into the staging buffer
      const uint64_t n = std::min(r.dst + r.nbytes, staged) - r.dst;
      if (small) {
        desc_[ring][desc_used++] = GatherDesc{r.src, staging_ptr_ + r.dst, n};
      } else {
        batch.add(reinterpret_cast<void*>(staging_ptr_ + r.dst),
                  reinterpret_cast<const void*>(r.src), n, cudaMemcpyDeviceToDevice);
      }
      off = n;
      if (off == r.nbytes) continue;
    }
    if (room() && r.dst + off >= next_mark) mark_at(r.dst + off);
    if (small) {
      desc_[ring][desc_used++] = GatherDesc{r.src + off, data_dev + r.dst + off, r.nbytes - off};
      continue;
    }
    while (off < r.nbytes) {
      uint64_t n = r.nbytes - off;
      const uint64_t at = r.dst + off;
      const bool split = room() && at < next_mark && at + n > next_mark;
      if (split) n = next_mark - at;
      batch.add(data + at, reinterpret_cast<const void*>(r.src + off), n,
                cudaMemcpyDeviceToHost);
      off += n;
      if (split) mark_at(at + n);
    }
  }
  launch_pending();
  last_memcpy_.fetch_add(memcpys);
  last_gathered_.fetch_add(gathered);
}

void CudaCopyEngine::drain(const CopyPlan& plan, uint64_t staged, uint8_t* data, int ring,
                           std::vector<std::pair<int, uint64_t>>* marks) {
  // Only the staged bytes of device ranges come from the buffer: host ranges (CPU
  // tensors of the state) were written into the slot at submit and the buffer never
  // held them. Neighbouring ranges are drained as one interval across an alignment gap
  // (padding, zeroed before the checksum) but never across a host range.
  std::vector<std::pair<uint64_t, uint64_t>> spans;  // [lo, hi) of the data area
  bool barrier = true;
  for (const PlanRange& r : plan.ranges) {
    if (r.nbytes == 0) continue;
    if (r.dst >= staged) break;
    if (r.host) {
      barrier = true;
      continue;
    }
    const uint64_t lo = r.dst, hi = std::min(r.dst + r.nbytes, staged);
    if (!barrier && lo >= spans.back().second && lo - spans.back().second < kPage)
      spans.back().second = std::max(spans.back().second, hi);
    else
      spans.emplace_back(lo, hi);
    barrier = false;
  }
  const uint64_t cb = plan.chunk_bytes;
  const uint64_t group = std::max<uint64_t>(1, (staged / (kMarks + 1) + cb - 1) / cb) * cb;
  uint64_t next_mark = group, memcpys = 0;
  CopyBatch batch;
  auto room = [&] { return marks->size() < size_t(kMarks); };
  auto mark_at = [&](uint64_t off) {  // every byte below `off` has landed once it completes
    flush_batch(batch, memcpys);
    int k = static_cast<int>(marks->size());
    CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_mark_[ring][k], copy_stream_));
    marks->emplace_back(k, off / cb);
    next_mark = (off / cb) * cb + group;
  };
  for (const auto& [lo, hi] : spans) {
    if (room() && lo >= next_mark) mark_at(lo);  // a host range or a gap passed the mark
    for (uint64_t at = lo; at < hi;) {
      uint64_t n = hi - at;
      const bool split = room() && at < next_mark && at + n > next_mark;
      if (split) n = next_mark - at;
      batch.add(data + at, reinterpret_cast<const void*>(staging_ptr_ + at), n,
                cudaMemcpyDeviceToHost);
      at += n;
      if (split) mark_at(at);
    }
  }
  flush_batch(batch, memcpys);
  last_memcpy_.fetch_add(memcpys);
}

void CudaCopyEngine::set_device_staging(uint64_t ptr, uint64_t bytes) {
  CUDASNAP_CHECK((ptr == 0) == (bytes == 0),
                 "device staging: give both a buffer and its size, or neither (off)");
  if (ptr) {
    DeviceGuard g(device_);
    cudaPointerAttributes a{};
    CUDASNAP_CUDA_CHECK(cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(ptr)));
    CUDASNAP_CHECK_KIND(ErrorKind::Cuda, a.type == cudaMemoryTypeDevice && a.device == device_,
                        "device staging buffer 0x" << std::hex << ptr << std::dec
                                                   << " is not device memory of cuda:" << device_);
  }
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, !hung_.load(),
                      "device staging not changed: a copy was abandoned on a hung GPU and may "
                      "still write into the old buffer");
  std::unique_lock<std::mutex> lk(mu_);
  CUDASNAP_CHECK(!shut_, "CUDA copy engine is shut down");
  const double wait_s = wait_timeout_s();  // the running copy may read the old buffer
  bool idle = idle_cv_.wait_for(lk, std::chrono::duration<double>(wait_s),
                                [&] { return !in_flight_ || shut_; });
  CUDASNAP_CHECK(!shut_, "CUDA copy engine is shut down");
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, idle,
                      "device staging not changed: the running snapshot is still copying after "
                          << wait_s << " s");
  staging_ptr_ = ptr;
  staging_bytes_ = bytes;
}

uint64_t CudaCopyEngine::device_staging_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return staging_bytes_;
}

void CudaCopyEngine::check_compute_stream(cudaStream_t compute, uint64_t stream) {
  DeviceGuard g(device_);  // stream 0: this device's legacy default stream
  if (stream != 0) {
    int sdev = -1;
    CUDASNAP_CUDA_CHECK(cudaStreamGetDevice(compute, &sdev));
    CUDASNAP_CHECK_KIND(ErrorKind::Cuda, sdev == device_,
                        "compute stream 0x" << std::hex << stream << std::dec
                                            << " belongs to cuda:" << sdev
                                            << ", the copy engine to cuda:" << device_);
  }
  // Work recorded on a capturing stream would go into the trainer's graph
  // (and an event wait from outside would invalidate it): no snapshot now.
  // Staging kind: Snapshotter.boundary() skips the step and counts it.
  bool implicit = false;
  CUDASNAP_CHECK_KIND(
      ErrorKind::Staging, !stream_capturing(compute, &implicit),
      "snapshot skipped: "
          << (implicit ? "another (blocking) stream of cuda:" + std::to_string(device_) +
                             " is capturing a CUDA graph, which the legacy default stream "
                             "(the compute stream) joins"
                       : std::string("the compute stream is capturing a CUDA graph"))
          << "; call boundary() outside graph capture");
}

int CudaCopyEngine::claim_ring(uint64_t total_bytes, uint64_t* staged) {
  std::unique_lock<std::mutex> lk(mu_);
  CUDASNAP_CHECK(!shut_, "CUDA copy engine is shut down");
  double wait_s = wait_timeout_s();  // one snapshot at a time, waited for a bounded time
  bool idle = idle_cv_.wait_for(lk, std::chrono::duration<double>(wait_s),
                                [&] { return !in_flight_ || shut_; });
  CUDASNAP_CHECK(!shut_, "CUDA copy engine is shut down");
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, idle,
                      "the previous snapshot is still copying after " << wait_s << " s");
  in_flight_ = true;
  *staged = std::min(staging_bytes_, total_bytes);
  const int ring = ring_next_;
  ring_next_ = (ring_next_ + 1) % kRing;
  return ring;
}

void CudaCopyEngine::not_in_flight() {
  {
    std::lock_guard<std::mutex> g(mu_);
    in_flight_ = false;
  }
  idle_cv_.notify_all();
}

void CudaCopyEngine::reserve_gather_descs(int ring, uint64_t ngather) {
  if (ngather <= desc_cap_[ring]) return;
  CaptureModeGuard relaxed;  // another thread may be capturing a graph
  if (desc_[ring]) CUDASNAP_CUDA_CHECK(cudaFreeHost(desc_[ring]));
  desc_[ring] = nullptr;
  desc_cap_[ring] = 0;
  uint64_t want = std::max<uint64_t>(ngather * 2, 256);
  CUDASNAP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&desc_[ring]),
                                    want * sizeof(GatherDesc),
                                    cudaHostAllocPortable | cudaHostAllocMapped));
  desc_cap_[ring] = want;
}

std::shared_ptr<CudaCopyEngine::Work> CudaCopyEngine::new_work(
    const std::shared_ptr<CopyJob>& job, const std::shared_ptr<Arena>& arena,
    const std::shared_ptr<const CopyPlan>& plan, int slot, int ring) {
  auto w = std::make_shared<Work>();
  w->job = job;
  w->arena = arena;
  w->plan = plan;
  w->slot = slot;
  w->ring = ring;
  uint64_t cursor = 0;  // alignment padding: zeroed by the completion thread
  for (const PlanRange& r : plan->ranges) {
    if (r.dst > cursor) w->pads.emplace_back(cursor, r.dst);
    cursor = std::max(cursor, r.dst + r.nbytes);
  }
  if (cursor < plan->total_bytes) w->pads.emplace_back(cursor, plan->total_bytes);
  return w;
}

std::vector<std::pair<int, uint64_t>> CudaCopyEngine::issue_copies(
    const CopyPlan& plan, cudaStream_t compute, uint8_t* data, uint64_t data_dev, int ring,
    uint64_t staged) {
  uint64_t desc_used = 0;
  CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_[ring][0], compute));
  CUDASNAP_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, ev_[ring][0], 0));
  if (uint64_t us = test_delay_us_.load())
    CUDASNAP_CUDA_CHECK(cudaLaunchHostFunc(copy_stream_, sleep_host_fn,
                                           reinterpret_cast<void*>(uintptr_t(us))));
  std::vector<std::pair<int, uint64_t>> marks;
  issue(plan, 0, data, data_dev, ring, desc_used, nullptr, staged);
  CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_[ring][1], copy_stream_));
  issue(plan, 1, data, data_dev, ring, desc_used, staged ? nullptr : &marks, staged);
  CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_[ring][2], copy_stream_));  // the fences' "done"
  if (staged) {
    // The fences are released; the staged part drains to the host behind them.
    drain(plan, staged, data, ring, &marks);
    CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_[ring][3], copy_stream_));
  }
  return marks;
}

void CudaCopyEngine::add_segments(Work& w, const CopyPlan& plan, int ring, uint64_t staged,
                                  const std::vector<std::pair<int, uint64_t>>& marks) {
  const uint64_t nch = plan.num_chunks(), cb = plan.chunk_bytes;
  auto add_marks = [&](uint64_t c, uint64_t limit) {  // -> the first chunk after them
    for (const auto& [k, cov] : marks) {
      uint64_t u = std::min(cov, limit);
      if (u > c) w.segs.push_back(Seg{ev_mark_[ring][k], c, u, false});
      c = std::max(c, u);
    }
    return c;
  };
  if (staged) {
    const uint64_t d = std::min(nch, (staged + cb - 1) / cb);  // chunks with staged bytes
    w.segs.push_back(Seg{ev_[ring][1], 0, 0, true});
    w.segs.push_back(Seg{ev_[ring][2], d, nch, false});  // copied directly: landed at done
    w.segs.push_back(Seg{ev_[ring][3], add_marks(0, d), d, false});
    w.last = ev_[ring][3];
  } else {
    const uint64_t p0 = std::min(plan.phase0_bytes / cb, nch);  // wholly phase-0 chunks
    w.segs.push_back(Seg{ev_[ring][1], 0, p0, true});
    w.segs.push_back(Seg{ev_[ring][2], add_marks(p0, nch), nch, false});
    w.last = ev_[ring][2];
  }
}

void CudaCopyEngine::abort_submit(Arena& arena, int slot, bool issued, bool began) {
  if (issued) {
    // Never leave a DMA running into a slot we give up on (bounded wait).
    DeviceGuard dev(device_, DeviceGuard::NoThrow{});  // the drain event: this device's
    CaptureModeGuard relaxed(CaptureModeGuard::NoThrow{});  // cudaEventQuery
    cudaEvent_t drain = nullptr;
    bool drained = false;
    if (cudaEventCreateWithFlags(&drain, cudaEventDisableTiming) == cudaSuccess) {
      if (cudaEventRecord(drain, copy_stream_) == cudaSuccess) {
        try {
          wait_event(drain, deadline_after(wait_timeout_s()), "the aborted copy");
          drained = true;
        } catch (...) {
        }
      }
      (void)cudaEventDestroy(drain);
    }
    if (!drained) note_dma_abandoned(arena);  // see finish()
    (void)cudaGetLastError();
  }
  if (began) {
    try {
      arena.invalidate(slot);
    } catch (...) {
    }
  }
  not_in_flight();
}

std::shared_ptr<CopyJob> CudaCopyEngine::submit(const std::shared_ptr<Arena>& arena, int slot,
                                                const std::shared_ptr<const CopyPlan>& plan,
                                                int64_t step, const SlotMeta& meta,
                                                uint64_t stream) {
  check_submit(arena, plan);
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, arena->cuda_registered,
                      "staging arena " << arena->path()
                                       << " is not page-locked for CUDA: register it with "
                                          "register_arena() or use "
                                          "create_private_pinned_arena() (an asynchronous "
                                          "copy into pageable memory would block)");
  uint64_t ngather = 0;
  for (const PlanRange& r : plan->ranges)
    if (!r.host && r.nbytes && gather_small_ && r.nbytes < gather_max_) ++ngather;

  cudaStream_t compute = reinterpret_cast<cudaStream_t>(stream);
  check_compute_stream(compute, stream);

  uint64_t staged = 0;  // bytes of this snapshot staged on the device
  const int ring = claim_ring(plan->total_bytes, &staged);
  if (staged) ngather *= 2;  // a small range may be split into a staged and a direct part

  bool began = false, issued = false;
  try {
    DeviceGuard g(device_);
    reserve_gather_descs(ring, ngather);
    uint64_t data_dev = 0;
    uint8_t* data = arena->data(slot);
    if (ngather) {
      void* base_dev = nullptr;
      CUDASNAP_CUDA_CHECK(cudaHostGetDevicePointer(&base_dev, arena->base(), 0));
      data_dev = reinterpret_cast<uint64_t>(base_dev) + uint64_t(data - arena->base());
    }

    arena->begin_write(slot, step, meta);
    began = true;
    auto job = std::make_shared<CopyJob>(slot, step, plan->total_bytes);
    job->submit_ns = monotonic_ns();
    for (int k = 0; k < 3; ++k) job->cuda_events[k] = ev_[ring][k];

    // Host state is tiny and changes right after boundary(): copy it now.
    for (const PlanRange& r : plan->ranges)
      if (r.host && r.nbytes)
        std::memcpy(data + r.dst, reinterpret_cast<const void*>(r.src), r.nbytes);

    if (plan->num_chunks() == 0) {
      arena->commit(slot, step, 0);
      job->mark(1);
      not_in_flight();
      return job;
    }

    std::shared_ptr<Work> w = new_work(job, arena, plan, slot, ring);
    last_memcpy_.store(0);
    last_gathered_.store(0);
    issued = true;
    const auto marks = issue_copies(*plan, compute, data, data_dev, ring, staged);
    add_segments(*w, *plan, ring, staged, marks);
    last_staged_.store(staged);
    CUDASNAP_CUDA_CHECK(wake_after(copy_stream_, wake_));  // COMPLETE without a poll's delay
    {
      std::lock_guard<std::mutex> lk(mu_);
      pending_ = w;
    }
    cv_.notify_all();
    return job;
  } catch (...) {
    abort_submit(*arena, slot, issued, began);
    throw;
  }
}

// ---------------------------------------------------------------- fence

bool CudaCopyEngine::fence(CopyJob& job, int phase, uint64_t stream) {
  CUDASNAP_CHECK(phase == 0 || phase == 1, "phase must be 0 or 1, got " << phase);
  if (job.done(phase)) return true;  // also true when the job failed
  auto ev = static_cast<cudaEvent_t>(job.cuda_events[phase == 0 ? 1 : 2]);
  CUDASNAP_CHECK(ev != nullptr, "fence: the job was not submitted by a CUDA copy engine");
  DeviceGuard g(device_);  // stream 0 means this device's legacy default stream
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  bool implicit = false;  // the legacy stream while a blocking stream captures: capturing too
  if (stream_capturing(s, &implicit)) {
    // A wait on an event recorded outside the capture would invalidate it; no
    // kernel runs while capturing, so a host wait here orders nothing away.
    double wait_s = wait_timeout_s();
    if (job.wait(phase, wait_s)) return true;
    if (job.cancel("snapshot copy abandoned: a fence inside graph capture waited " +
                   std::to_string(wait_s) + " s"))
      return false;
    return job.wait(phase, wait_s);
  }
  CUDASNAP_CUDA_CHECK(cudaStreamWaitEvent(s, ev, 0));
  return true;
}

// ----------------------------------------------------- completion thread

void CudaCopyEngine::completion_loop() {
  (void)cudaSetDevice(device_);
  for (;;) {
    std::shared_ptr<Work> w;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || pending_; });
      if (!pending_) return;  // stop_ and nothing left
      w = std::move(pending_);
    }
    finish(*w);
    w.reset();  // the arena reference goes before busy() turns false (regrowth unmaps it)
    {
      std::lock_guard<std::mutex> g(mu_);
      in_flight_ = false;
    }
    idle_cv_.notify_all();
  }
}

void CudaCopyEngine::crc_chunks(const CopyPlan& plan, const uint8_t* data, uint32_t* table,
                                uint64_t c0, uint64_t c1) {
  if (c1 <= c0) return;
  uint64_t n = c1 - c0;
  // Small snapshots: one thread is faster. While a flush runs in this process it
  // gets the cores and memory bandwidth (flush-yield: one CRC thread, pausing
  // between chunks; checked again at every chunk).
  int threads = n < 2 || n * plan.chunk_bytes < kParallelCrcBytes ? 1 : crc_threads_;
  parallel_for(n, threads, [&](uint64_t i) { table[c0 + i] = chunk_crc(plan, data, c0 + i); },
               BatchOptions{/*should_yield=*/flush_running, /*yield_pause_us=*/100});
}

void CudaCopyEngine::finish(Work& w) {
  const CopyPlan& plan = *w.plan;
  CopyJob& job = *w.job;
  try {
    uint8_t* data = w.arena->data(w.slot);
    uint32_t* table = w.arena->table(w.slot);
    // Padding is zeroed only once no DMA can touch the bytes around it.
    auto zero_pads = [&](uint64_t lo, uint64_t hi) {
      for (const auto& p : w.pads) {
        uint64_t a = std::max(lo, p.first), b = std::min(hi, p.second);
        if (a < b) std::memset(data + a, 0, b - a);
      }
    };
    const uint64_t deadline = deadline_after(wait_timeout_s());
    const uint64_t cb = plan.chunk_bytes;
    // Checksum each region once its copy has landed, while the later ones still copy.
    // Each round also takes the following regions whose copies have landed by then
    // (all CRC threads on them), so a checksum that fell behind catches up in larger
    // batches instead of lagging one mark at a time (COMPLETE close to the copy time).
    for (size_t i = 0; i < w.segs.size();) {
      const Seg& s = w.segs[i];
      wait_event(s.ev, deadline, s.phase0 ? "the phase-0 copy (buffers)" : "the snapshot copy");
      if (s.phase0) job.mark(0);
      size_t j = i;
      while (j + 1 < w.segs.size() && w.segs[j + 1].c0 == w.segs[j].c1 &&
             !w.segs[j + 1].phase0 && event_done(w.segs[j + 1].ev))
        ++j;
      const uint64_t c0 = s.c0, c1 = w.segs[j].c1;
      i = j + 1;
      if (c1 <= c0) continue;
      zero_pads(c0 * cb, std::min(c1 * cb, plan.total_bytes));  // no DMA writes there now
      crc_chunks(plan, data, table, c0, c1);
    }
    // A job a fence gave up on (cancelled) is never published: the trainer
    // went on writing while it copied.
    CUDASNAP_CHECK_KIND(ErrorKind::Staging, job.begin_commit(), "cancelled: " << job.error());
    w.arena->commit(w.slot, job.step(), plan.total_bytes);
    job.mark(1);
  } catch (const std::exception& e) {
    bool drained = false;
    if (!hung_.load() && !abandon_.load()) {
      try {  // no DMA may still run into the slot (bounded: a hung GPU gives up)
        wait_event(w.last ? w.last : ev_[w.ring][2], deadline_after(wait_timeout_s()),
                   "the failed copy");
        drained = true;
      } catch (...) {
      }
    }
    // A DMA may still write into the arena: ~Arena must not unlock its pages.
    if (!drained) note_dma_abandoned(*w.arena);
    (void)cudaGetLastError();
    try {
      w.arena->invalidate(w.slot);
    } catch (...) {
    }
    job.fail(std::string("CUDA snapshot copy on cuda:") + std::to_string(device_) + ": " +
             e.what());
  }
}

}  // namespace cudasnap
