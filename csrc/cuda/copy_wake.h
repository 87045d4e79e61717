// CopyWake: a host thread waiting for a point of a CUDA stream is woken the moment the
// stream passes it (a host function enqueued there, wake_after()), instead of at its next
// event poll. The waiter still polls its event (the event is the truth; the wake only
// shortens the sleep) against its own deadline, so a lost wake costs one poll interval.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

namespace cudasnap {

struct CopyWake {
  uint64_t generation() {
    std::lock_guard<std::mutex> g(mu);
    return gen;
  }
  void notify() {
    {
      std::lock_guard<std::mutex> g(mu);
      ++gen;
    }
    cv.notify_all();
  }
  // Sleeps up to `us` microseconds unless notify() ran since generation() gave `seen`.
  void wait_for(uint64_t seen, uint64_t us) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait_for(lk, std::chrono::microseconds(us), [&] { return gen != seen; });
  }
  std::mutex mu;
  std::condition_variable cv;
  uint64_t gen = 0;
};

// Enqueues on `stream` a host function that notifies `wake` when the stream reaches it
// (it holds a reference: the waiter may be gone by then). Returns the launch status.
cudaError_t wake_after(cudaStream_t stream, const std::shared_ptr<CopyWake>& wake);

}  // namespace cudasnap
