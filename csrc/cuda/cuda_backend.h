// CUDA backend entry points (compiled only with CUDASNAP_WITH_CUDA).
//
//   cuda_backend.cpp       device count, arena registration, private pinned arenas
//   copy_engine_cuda.cpp   CudaCopyEngine (side stream, events, completion thread)
//   tracker_hook.cpp       attaches the AllocatorRegistry to the caching allocator
//   gather.cu              optional small-range gather kernel
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "../allocator_tracker.h"
#include "../staging.h"

namespace cudasnap {

// Number of visible CUDA devices; 0 when no driver or device is present.
int cuda_device_count();

struct RegisterResult {
  bool ok = false;
  std::string reason;  // why not (or "already registered")
};

// Page-locks the whole arena with one cudaHostRegister(Portable | Mapped) on
// `device` (< 0: the current device) and sets arena.cuda_registered and
// arena.release_registration (~Arena unregisters before it unmaps). Returns
// false and a reason when the device or the system refuses (no
// cudaDevAttrHostRegisterSupported, memlock limit, read-only arena); throws
// CudaError when the CUDA runtime itself is unusable. Registrations are kept
// by Arena::serial(), never by address. Relaxed capture mode (capture_mode.h):
// safe on any thread while another captures a CUDA graph.
RegisterResult register_arena(Arena& arena, int device);
// Undoes register_arena now (a no-op for arenas it did not register); without
// it ~Arena does. Relaxed capture mode, as register_arena.
void unregister_arena(Arena& arena);
// A copy engine gave up on a DMA into `arena` that may still run (hung or
// lost GPU, abandoned at shutdown): ~Arena then leaves the registration in
// place instead of unregistering, so the pages the DMA may still write stay
// locked (and cudaHostUnregister cannot block on the device). An explicit
// unregister_arena() still unregisters: the caller decided.
void note_dma_abandoned(Arena& arena) noexcept;
// A process-private staging arena in cudaHostAlloc'd pinned memory (the
// fallback when register_arena fails), allocated and freed with `device` (< 0:
// the current device) current, whatever thread frees it. It does not outlive
// the process.
// cudaHostAlloc / cudaFreeHost run in relaxed capture mode.
std::shared_ptr<Arena> create_private_pinned_arena(int num_slots, uint64_t data_capacity,
                                                   uint64_t meta_capacity, uint64_t chunk_bytes,
                                                   const std::string& job, int device = -1);

// Attaches a process-global AllocatorRegistry (a leaked singleton: torch has
// no way to detach a trace tracker) to the CUDA caching allocator, then seeds
// it from CUDACachingAllocator::snapshot(). Needs CUDA lazy init done
// (torch.cuda.init()); throws a clear error otherwise, or when the allocator
// backend is not the native caching allocator. Later calls return the same
// registry. `auto_drain` > 0 starts its background drain thread at that
// queue length.
std::shared_ptr<AllocatorRegistry> attach_allocator_tracker(uint64_t auto_drain);
// The registry attach_allocator_tracker() created, or null.
std::shared_ptr<AllocatorRegistry> attached_allocator_registry();

}  // namespace cudasnap
