#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <set>
#include <sstream>

#include "../error.h"

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
std::set<const uint8_t*> g_registered;  // arena bases cudaHostRegister'ed by us

std::string cuda_err(cudaError_t st) {
  std::ostringstream os;
  os << cudaGetErrorName(st) << ": " << cudaGetErrorString(st);
  return os.str();
}

thread_local std::string t_alloc_error;

void* pinned_alloc(uint64_t bytes) {
  void* p = nullptr;
  cudaError_t st = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (st != cudaSuccess) {
    (void)cudaGetLastError();
    std::ostringstream os;
    os << "cudaHostAlloc(" << bytes << " bytes, Portable|Mapped) failed: " << cuda_err(st);
    t_alloc_error = os.str();
    return nullptr;
  }
  return p;
}

void pinned_free(void* p) {
  if (p) (void)cudaFreeHost(p);  // at exit the runtime may be gone: nothing to report to
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
  int prev = -1;
  CUDASNAP_CUDA_CHECK(cudaGetDevice(&prev));
  if (prev != device) CUDASNAP_CUDA_CHECK(cudaSetDevice(device));
  cudaError_t st = cudaHostRegister(arena.base(), arena.total_bytes(), flags);
  if (prev != device) (void)cudaSetDevice(prev);
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
    g_registered.insert(arena.base());
  }
  arena.cuda_registered = true;
  r.ok = true;
  return r;
}

void unregister_arena(Arena& arena) {
  {
    std::lock_guard<std::mutex> g(g_reg_mu);
    if (!g_registered.erase(arena.base())) return;  // not ours (e.g. a private pinned arena)
  }
  arena.cuda_registered = false;
  CUDASNAP_CUDA_CHECK(cudaHostUnregister(arena.base()));
}

std::shared_ptr<Arena> create_private_pinned_arena(int num_slots, uint64_t data_capacity,
                                                   uint64_t meta_capacity, uint64_t chunk_bytes,
                                                   const std::string& job) {
  t_alloc_error.clear();
  std::shared_ptr<Arena> a;
  try {
    a = Arena::create_private(num_slots, data_capacity, meta_capacity, chunk_bytes, job,
                              &pinned_alloc, &pinned_free);
  } catch (const Error&) {
    if (!t_alloc_error.empty()) {
      std::string msg = "private pinned staging arena: " + t_alloc_error;
      t_alloc_error.clear();
      throw_error(ErrorKind::Cuda, __FILE__, __LINE__, msg);
    }
    throw;
  }
  a->cuda_registered = true;  // pinned: usable for asynchronous DMA
  return a;
}

}  // namespace cudasnap
