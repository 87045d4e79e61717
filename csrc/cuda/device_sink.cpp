#include "device_sink.h"

#include <chrono>
#include <thread>

#include "../error.h"
#include "../staging.h"  // monotonic_ns
#include "capture_mode.h"
#include "device_guard.h"

namespace cudasnap {

CudaUnitSink::CudaUnitSink(int device, int threads, double wait_s)
    : device_(device), wait_s_(wait_s) {
  CUDASNAP_CHECK(threads >= 1 && threads <= 256, "CudaUnitSink: threads must be 1..256, got "
                                                     << threads);
  int count = 0;
  CUDASNAP_CUDA_CHECK(cudaGetDeviceCount(&count));
  CUDASNAP_CHECK_KIND(ErrorKind::Cuda, device >= 0 && device < count,
                      "CudaUnitSink: device " << device << " out of range (" << count
                                              << " CUDA devices visible)");
  lanes_.resize(static_cast<size_t>(threads));
  try {
    DeviceGuard g(device_);
    for (Lane& l : lanes_) {
      CUDASNAP_CUDA_CHECK(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking));
      for (auto& e : l.ev)  // waited on by a reader: sleep, do not spin
        CUDASNAP_CUDA_CHECK(
            cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync));
    }
  } catch (...) {
    release();
    throw;
  }
}

CudaUnitSink::~CudaUnitSink() {
  try {
    drain();
  } catch (...) {
    hung_ = true;  // a copy may still read the buffers: leak them (release())
  }
  release();
}

void CudaUnitSink::release() noexcept {
  DeviceGuard g(device_, DeviceGuard::NoThrow{});
  CaptureModeGuard relaxed(CaptureModeGuard::NoThrow{});  // cudaFreeHost: see capture_mode.h
  for (Lane& l : lanes_) {
    for (int i = 0; i < kBufs; ++i) {
      if (l.buf[i] && !hung_) (void)cudaFreeHost(l.buf[i]);
      l.buf[i] = nullptr;
      if (l.ev[i]) (void)cudaEventDestroy(l.ev[i]);
      l.ev[i] = nullptr;
    }
    if (l.stream) (void)cudaStreamDestroy(l.stream);
    l.stream = nullptr;
  }
  (void)cudaGetLastError();
}

CudaUnitSink::Lane& CudaUnitSink::lane(int t) {
  CUDASNAP_CHECK(t >= 0 && static_cast<size_t>(t) < lanes_.size(),
                 "CudaUnitSink: reader " << t << " of " << lanes_.size());
  return lanes_[static_cast<size_t>(t)];
}

void CudaUnitSink::wait(Lane& l, int i) {
  const uint64_t deadline = monotonic_ns() + static_cast<uint64_t>(wait_s_ * 1e9);
  uint64_t sleep_us = 50;
  for (;;) {
    const uint64_t gen = l.wake->generation();
    cudaError_t st = cudaEventQuery(l.ev[i]);
    if (st == cudaSuccess) break;
    if (st != cudaErrorNotReady) CUDASNAP_CUDA_CHECK(st);
    (void)cudaGetLastError();  // cudaErrorNotReady is recorded as the last error too
    CUDASNAP_CHECK_KIND(ErrorKind::Cuda, monotonic_ns() < deadline,
                        "a restore copy to the device did not complete within "
                            << wait_s_ << " s: the GPU is hung or lost");
    l.wake->wait_for(gen, sleep_us);  // ends early when the lane's copies are done
    sleep_us = std::min<uint64_t>(sleep_us * 2, 1000);
  }
  l.pending[i] = false;
}

uint8_t* CudaUnitSink::buffer(int t, uint64_t bytes) {
  Lane& l = lane(t);
  DeviceGuard g(device_);
  const int i = (l.cur + 1) % kBufs;
  if (l.pending[i]) wait(l, i);  // copies from this buffer's last unit must have read it
  if (l.cap[i] < bytes) {
    CaptureModeGuard relaxed;
    if (l.buf[i]) CUDASNAP_CUDA_CHECK(cudaFreeHost(l.buf[i]));
    l.buf[i] = nullptr;
    l.cap[i] = 0;
    CUDASNAP_CUDA_CHECK(
        cudaHostAlloc(reinterpret_cast<void**>(&l.buf[i]), bytes, cudaHostAllocPortable));
    l.cap[i] = bytes;
  }
  l.cur = i;
  return l.buf[i];
}

void CudaUnitSink::copy(int t, uint64_t dst, const uint8_t* src, uint64_t n) {
  Lane& l = lane(t);
  DeviceGuard g(device_);
  l.unrecorded = true;  // drain() covers it even if unit_done() never comes
  CUDASNAP_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(dst), src, n,
                                      cudaMemcpyHostToDevice, l.stream));
  ++l.copies;
}

void CudaUnitSink::unit_done(int t) {
  Lane& l = lane(t);
  DeviceGuard g(device_);
  CUDASNAP_CUDA_CHECK(cudaEventRecord(l.ev[l.cur], l.stream));
  l.pending[l.cur] = true;
  l.unrecorded = false;
  CUDASNAP_CUDA_CHECK(wake_after(l.stream, l.wake));
}

void CudaUnitSink::drain() {
  DeviceGuard g(device_);
  for (Lane& l : lanes_) {
    if (l.unrecorded) {  // a unit cut short (a failed copy call): its copies still count
      CUDASNAP_CUDA_CHECK(cudaEventRecord(l.ev[l.cur], l.stream));
      l.pending[l.cur] = true;
      l.unrecorded = false;
    }
    for (int i = 0; i < kBufs; ++i)
      if (l.pending[i]) wait(l, i);
  }
}

uint64_t CudaUnitSink::copies() const {
  uint64_t n = 0;
  for (const Lane& l : lanes_) n += l.copies;
  return n;
}

uint64_t CudaUnitSink::pinned_bytes() const {
  uint64_t n = 0;
  for (const Lane& l : lanes_)
    for (uint64_t c : l.cap) n += c;
  return n;
}

}  // namespace cudasnap
