#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include <map>
#include <optional>
#include <mutex>
#include <set>
#include <sstream>

#include "../error.h"
#include "capture_mode.h"
#include "device_guard.h"

namespace cudasnap {

int cuda_device_count() {
  int n = 0;
  cudaError_t st = cudaGetDeviceCount(&n);
  if (st == cudaErrorNoDevice || st == cudaErrorInsufficientDriver) {
    (void)cudaGetLastError();
    return 0;
  }
  CUDASNAP_CUDA_CHECK(st);
  return n;
}

namespace {

std::mutex g_reg_mu;
// Arenas cudaHostRegister'ed by us, by Arena::serial(): never by address, which
// a later mapping may reuse once the arena is unmapped.
std::set<uint64_t> g_registered;
std::set<uint64_t> g_abandoned;  // registered arenas a DMA may still write (note_dma_abandoned)

// Forgets `arena`'s registration; true when it was ours (then the caller
// unregisters the range).
bool forget_registration(Arena& arena, bool* abandoned = nullptr) {
  std::lock_guard<std::mutex> g(g_reg_mu);
  if (!g_registered.erase(arena.serial())) return false;
  bool a = g_abandoned.erase(arena.serial()) > 0;
  if (abandoned) *abandoned = a;
  arena.cuda_registered = false;
  arena.release_registration = nullptr;
  return true;
}

// Arena::release_registration: ~Arena, right before the unmap. It may run on
// any thread (the completion thread drops its arena reference, Python drops
// the last one) and at interpreter exit, when the runtime may be unloading:
// nothing to report to, the mapping goes anyway.
void release_on_unmap(Arena& arena) noexcept {
  bool abandoned = false;
  if (!forget_registration(arena, &abandoned)) return;
  if (abandoned) return;  // see note_dma_abandoned()
  CaptureModeGuard relaxed(CaptureModeGuard::NoThrow{});
  // ~Arena may run on any thread (GC, atexit): no context on device 0 from there.
  DeviceGuard dev(arena.cuda_device >= 0 ? arena.cuda_device : 0, DeviceGuard::NoThrow{});
  if (cudaHostUnregister(arena.base()) != cudaSuccess) (void)cudaGetLastError();
}

std::string cuda_err(cudaError_t st) {
  std::ostringstream os;
  os << cudaGetErrorName(st) << ": " << cudaGetErrorString(st);
  return os.str();
}

thread_local std::string t_alloc_error;
thread_local int t_alloc_device = -1;     // create_private_pinned_arena's device
std::map<void*, int> g_pinned_device;     // under g_reg_mu: each private arena's device

// Both run on the arena preparer thread as well as the trainer's: relaxed
// capture mode, so a graph capture running meanwhile is not invalidated. Each
// makes its arena's device current (DeviceGuard): a thread whose current device
// is still 0 would otherwise make a context on GPU 0.
void* pinned_alloc(uint64_t bytes) {
  void* p = nullptr;
  // Not throwing: an unusable runtime is reported by cudaHostAlloc's own error below.
  CaptureModeGuard relaxed(CaptureModeGuard::NoThrow{});
  int device = t_alloc_device;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) device = 0;
  DeviceGuard dev(device, DeviceGuard::NoThrow{});
  cudaError_t st = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (st != cudaSuccess) {
    (void)cudaGetLastError();
    std::ostringstream os;
    os << "cudaHostAlloc(" << bytes << " bytes, Portable|Mapped) failed: " << cuda_err(st);
    t_alloc_error = os.str();
    return nullptr;
  }
  std::lock_guard<std::mutex> g(g_reg_mu);
  g_pinned_device[p] = device;
  return p;
}

void pinned_free(void* p) {
  if (!p) return;
  int device = -1;
  {
    std::lock_guard<std::mutex> g(g_reg_mu);
    auto it = g_pinned_device.find(p);
    if (it != g_pinned_device.end()) {
      device = it->second;
      g_pinned_device.erase(it);
    }
  }
  CaptureModeGuard relaxed(CaptureModeGuard::NoThrow{});
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) device = 0;
  DeviceGuard dev(device, DeviceGuard::NoThrow{});
  // At exit the runtime may be gone: nothing to report to.
  if (cudaFreeHost(p) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace

RegisterResult register_arena(Arena& arena, int device) {
  RegisterResult r;
  if (arena.cuda_registered) {
    r.ok = true;
    r.reason = "already registered";
    return r;
  }
  if (!arena.writable()) {
    r.reason = "arena " + arena.path() + " is mapped read-only";
    return r;
  }
  if (device < 0) CUDASNAP_CUDA_CHECK(cudaGetDevice(&device));
  int supported = 0, can_map = 0;
  CUDASNAP_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterSupported, device));
  CUDASNAP_CUDA_CHECK(cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, device));
  if (!supported) {
    r.reason = "cuda:" + std::to_string(device) +
               " does not support cudaHostRegister (cudaDevAttrHostRegisterSupported = 0)";
    return r;
  }
  unsigned flags = cudaHostRegisterPortable | (can_map ? cudaHostRegisterMapped : 0u);
  // The arena preparer registers on its own thread while the trainer may be
  // capturing a CUDA graph: in Global mode this call would invalidate it.
  CaptureModeGuard relaxed;
  cudaError_t st;
  {
    DeviceGuard dev(device);
    st = cudaHostRegister(arena.base(), arena.total_bytes(), flags);
  }
  if (st != cudaSuccess) {
    (void)cudaGetLastError();  // registration errors are not sticky
    std::ostringstream os;
    os << "cudaHostRegister of the " << arena.total_bytes() << "-byte staging arena "
       << arena.path() << " failed on cuda:" << device << ": " << cuda_err(st);
    if (st == cudaErrorMemoryAllocation)
      os << " (locked-memory limit? see `ulimit -l` / the container's memlock setting)";
    r.reason = os.str();
    return r;
  }
  {
    std::lock_guard<std::mutex> g(g_reg_mu);
    g_registered.insert(arena.serial());
    arena.release_registration = &release_on_unmap;  // ~Arena unregisters first
    arena.cuda_registered = true;
    arena.cuda_device = device;
  }
  r.ok = true;
  return r;
}

void note_dma_abandoned(Arena& arena) noexcept {
  std::lock_guard<std::mutex> g(g_reg_mu);
  if (g_registered.count(arena.serial())) g_abandoned.insert(arena.serial());
}

void unregister_arena(Arena& arena) {
  {
    std::lock_guard<std::mutex> g(g_reg_mu);
    if (!g_registered.count(arena.serial())) return;  // not ours (e.g. a private pinned arena)
  }
  // The guards before forgetting: once forgotten, nothing else would unregister the range.
  CaptureModeGuard relaxed;
  std::optional<DeviceGuard> dev;
  if (arena.cuda_device >= 0) dev.emplace(arena.cuda_device);
  if (!forget_registration(arena)) return;  // a concurrent unregister won
  CUDASNAP_CUDA_CHECK(cudaHostUnregister(arena.base()));
}

std::shared_ptr<Arena> create_private_pinned_arena(int num_slots, uint64_t data_capacity,
                                                   uint64_t meta_capacity, uint64_t chunk_bytes,
                                                   const std::string& job, int device) {
  t_alloc_error.clear();
  // No current device (no driver): pinned_alloc's cudaHostAlloc reports the error.
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    device = -1;
  }
  t_alloc_device = device;
  std::shared_ptr<Arena> a;
  try {
    a = Arena::create_private(num_slots, data_capacity, meta_capacity, chunk_bytes, job,
                              &pinned_alloc, &pinned_free);
  } catch (const Error&) {
    t_alloc_device = -1;
    if (!t_alloc_error.empty()) {
      std::string msg = "private pinned staging arena: " + t_alloc_error;
      t_alloc_error.clear();
      throw_error(ErrorKind::Cuda, __FILE__, __LINE__, msg);
    }
    throw;
  }
  t_alloc_device = -1;
  a->cuda_registered = true;  // pinned: usable for asynchronous DMA
  a->cuda_device = device;
  return a;
}

}  // namespace cudasnap
