// Restore to the device through page-locked chunks (issue 34 item 5): the UnitSink of
// read_verify_scatter (file_restore.h) for destinations in device memory.
//
// Each reader thread t owns a lane: a non-blocking stream, a ring of kBufs page-locked
// buffers (cudaHostAlloc, one unit each, made at first use) and an event per buffer. A
// unit is read into one buffer, verified chunk by chunk, and each verified piece's
// cudaMemcpyAsync (host to device, a DMA from page-locked memory) is queued on the
// lane's stream; unit_done() records the buffer's event, and the next units are read
// into the next buffers meanwhile: the disk reads overlap the copies, up to kBufs - 1
// units ahead. buffer() waits for a buffer's event before handing it out again, so a
// read never overwrites bytes a queued copy has still to read. drain() waits for every
// lane.
//
// Every wait polls its event against `wait_s` (a hung GPU fails the restore with a
// CudaError instead of hanging it); a host function after each unit's copies (CopyWake)
// ends the sleep between polls the moment they are done. The destructor waits the same way, then frees the
// buffers, events and streams; on a timeout it leaks the buffers rather than free memory
// a DMA may still read.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "../file_restore.h"
#include "copy_wake.h"

namespace cudasnap {

class CudaUnitSink : public UnitSink {
 public:
  CudaUnitSink(int device, int threads, double wait_s);
  ~CudaUnitSink() override;
  CudaUnitSink(const CudaUnitSink&) = delete;
  CudaUnitSink& operator=(const CudaUnitSink&) = delete;

  uint8_t* buffer(int t, uint64_t bytes) override;
  void copy(int t, uint64_t dst, const uint8_t* src, uint64_t n) override;
  void unit_done(int t) override;
  void drain() override;

  int device() const { return device_; }
  uint64_t copies() const;         // cudaMemcpyAsync calls queued so far
  uint64_t pinned_bytes() const;   // page-locked buffer bytes held

 private:
  static constexpr int kBufs = 4;
  struct Lane {
    cudaStream_t stream = nullptr;
    uint8_t* buf[kBufs] = {};
    uint64_t cap[kBufs] = {};
    cudaEvent_t ev[kBufs] = {};
    bool pending[kBufs] = {};  // copies from buf[i] were queued since its last wait
    int cur = kBufs - 1;       // the buffer handed out last
    bool unrecorded = false;   // copies queued since the last event (a unit cut short)
    uint64_t copies = 0;
    std::shared_ptr<CopyWake> wake = std::make_shared<CopyWake>();
  };
  Lane& lane(int t);
  void wait(Lane& l, int i);  // bounded poll of l.ev[i]
  void release() noexcept;

  int device_;
  double wait_s_;
  bool hung_ = false;
  std::vector<Lane> lanes_;
};

}  // namespace cudasnap
