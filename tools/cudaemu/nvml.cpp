// cudaemu's NVML: the functions nvidia-ml-py (pynvml) and torch call, on the
// emulated devices, so that cudasnap's health monitor runs its real NVML path
// (pynvml through ctypes) under the emulator, and faults reach it the way a
// driver reports them. build.py links libnvidia-ml.so.1 to this library.
//
// Faults (cudaemu_fault / CUDAEMU_FAULTS, see cudaemu.cpp):
//   nvml_xid:N         posts an Xid critical-error event with data N
//   nvml_ecc:N         N uncorrected volatile ECC errors (and a double-bit ECC event)
//   nvml_remap:P:F     remapped rows: pending P, failure F (0/1)
//   nvml_lost:1        every later call fails with NVML_ERROR_GPU_IS_LOST
//   nvml_recovery:N    the GPU recovery-action field reads N (and an event is posted)
//   nvml_temp:C        temperature C degrees; nvml_clocks:MASK clock event reasons
//   nvml_off:1         nvmlInit fails with NVML_ERROR_DRIVER_NOT_LOADED
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#define NVML_API extern "C" __attribute__((visibility("default")))

extern "C" int cudaGetDeviceCount(int*);

namespace {

enum : int {
  kSuccess = 0,
  kUninitialized = 1,
  kInvalidArgument = 2,
  kNotSupported = 3,
  kInsufficientSize = 7,
  kDriverNotLoaded = 9,
  kTimeout = 10,
  kGpuIsLost = 15,
  kNotFound = 6,
};

constexpr unsigned long long kXid = 0x8, kDoubleBitEcc = 0x2, kRecovery = 0x8000;
constexpr unsigned kFieldRecoveryAction = 230;

struct EventData {
  void* device;
  unsigned long long type;
  unsigned long long data;
  unsigned gi, ci;
};

struct EventSet {
  std::vector<std::pair<int, unsigned long long>> registered;  // (device, types)
  std::deque<EventData> q;
};

struct Nvml {
  std::mutex mu;
  std::condition_variable cv;
  int inits = 0;
  bool lost = false, off = false;
  unsigned long long ecc = 0;
  unsigned remap_pending = 0, remap_failure = 0;
  long long recovery = 0;
  unsigned temp = 40;
  unsigned long long clocks = 0;
  std::vector<EventSet*> sets;
};

Nvml& nv() {
  static Nvml* n = new Nvml();
  return *n;
}

int ndev() {
  int n = 0;
  cudaGetDeviceCount(&n);
  return n;
}

void* handle_of(int i) { return reinterpret_cast<void*>(uintptr_t(0x4e560000 + i)); }

int index_of(void* h) {
  auto v = static_cast<long long>(reinterpret_cast<uintptr_t>(h)) - 0x4e560000;
  return v >= 0 && v < ndev() ? static_cast<int>(v) : -1;
}

void post(unsigned long long type, unsigned long long data) {  // caller holds mu
  for (EventSet* s : nv().sets)
    for (auto& [d, types] : s->registered)
      if (types & type) s->q.push_back(EventData{handle_of(d), type, data, 0, 0});
  nv().cv.notify_all();
}

#define NVML_GUARD()                                        \
  do {                                                      \
    std::lock_guard<std::mutex> g_(nv().mu);                \
    if (nv().lost) return kGpuIsLost;                       \
    if (nv().inits <= 0) return kUninitialized;             \
  } while (0)

#define NVML_DEV(h)                     \
  int dev_ = index_of(h);               \
  if (dev_ < 0) return kInvalidArgument

}  // namespace

// Called by cudaemu.cpp's fault parser for keys starting with "nvml_".
extern "C" __attribute__((visibility("hidden"))) bool cudaemu_nvml_fault(const std::string& key,
                                                                         const std::string& val) {
  Nvml& n = nv();
  std::lock_guard<std::mutex> g(n.mu);
  unsigned long long v = strtoull(val.c_str(), nullptr, 0);
  if (key == "nvml_xid") {
    post(kXid, v);
  } else if (key == "nvml_ecc") {
    n.ecc = v;
    if (v) post(kDoubleBitEcc, 0);
  } else if (key == "nvml_remap") {
    size_t c = val.find(':');
    n.remap_pending = static_cast<unsigned>(strtoul(val.c_str(), nullptr, 0));
    n.remap_failure = c == std::string::npos ? 0 : static_cast<unsigned>(strtoul(val.c_str() + c + 1, nullptr, 0));
  } else if (key == "nvml_lost") {
    n.lost = v != 0;
    n.cv.notify_all();
  } else if (key == "nvml_recovery") {
    n.recovery = static_cast<long long>(v);
    if (v) post(kRecovery, v);
  } else if (key == "nvml_temp") {
    n.temp = static_cast<unsigned>(v);
  } else if (key == "nvml_clocks") {
    n.clocks = v;
  } else if (key == "nvml_off") {
    n.off = v != 0;
  } else if (key == "nvml_clear") {
    n.lost = n.off = false;
    n.ecc = n.clocks = 0;
    n.remap_pending = n.remap_failure = 0;
    n.recovery = 0;
    n.temp = 40;
    for (EventSet* s : n.sets) s->q.clear();
  } else {
    return false;
  }
  return true;
}

NVML_API const char* nvmlErrorString(int r) {
  switch (r) {
    case kSuccess: return "Success";
    case kUninitialized: return "Uninitialized";
    case kInvalidArgument: return "Invalid Argument";
    case kNotSupported: return "Not Supported";
    case kNotFound: return "Not Found";
    case kInsufficientSize: return "Insufficient Size";
    case kDriverNotLoaded: return "Driver Not Loaded";
    case kTimeout: return "Timeout";
    case kGpuIsLost: return "GPU is lost";
    default: return "Unknown Error";
  }
}

NVML_API int nvmlInitWithFlags(unsigned) {
  std::lock_guard<std::mutex> g(nv().mu);
  if (nv().off) return kDriverNotLoaded;
  ++nv().inits;
  return kSuccess;
}
NVML_API int nvmlInit_v2() { return nvmlInitWithFlags(0); }
NVML_API int nvmlInit() { return nvmlInitWithFlags(0); }

NVML_API int nvmlShutdown() {
  std::lock_guard<std::mutex> g(nv().mu);
  if (nv().inits <= 0) return kUninitialized;
  --nv().inits;
  return kSuccess;
}

NVML_API int nvmlSystemGetDriverVersion(char* out, unsigned len) {
  if (!out || len < 8) return kInsufficientSize;
  snprintf(out, len, "%s", "580.0-emu");
  return kSuccess;
}
NVML_API int nvmlSystemGetCudaDriverVersion_v2(int* v) {
  if (!v) return kInvalidArgument;
  *v = 13000;
  return kSuccess;
}
NVML_API int nvmlSystemGetCudaDriverVersion(int* v) { return nvmlSystemGetCudaDriverVersion_v2(v); }
NVML_API int nvmlSystemGetNVMLVersion(char* out, unsigned len) {
  if (!out || len < 8) return kInsufficientSize;
  snprintf(out, len, "%s", "13.580-emu");
  return kSuccess;
}

NVML_API int nvmlDeviceGetCount_v2(unsigned* n) {
  NVML_GUARD();
  if (!n) return kInvalidArgument;
  *n = static_cast<unsigned>(ndev());
  return kSuccess;
}
NVML_API int nvmlDeviceGetCount(unsigned* n) { return nvmlDeviceGetCount_v2(n); }

NVML_API int nvmlDeviceGetHandleByIndex_v2(unsigned i, void** h) {
  NVML_GUARD();
  if (!h || static_cast<int>(i) >= ndev()) return kInvalidArgument;
  *h = handle_of(static_cast<int>(i));
  return kSuccess;
}
NVML_API int nvmlDeviceGetHandleByIndex(unsigned i, void** h) { return nvmlDeviceGetHandleByIndex_v2(i, h); }

NVML_API int nvmlDeviceGetIndex(void* h, unsigned* i) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!i) return kInvalidArgument;
  *i = static_cast<unsigned>(dev_);
  return kSuccess;
}

NVML_API int nvmlDeviceGetUUID(void* h, char* out, unsigned len) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!out || len < 48) return kInsufficientSize;
  snprintf(out, len, "GPU-c0c1c2c3-c4c5-c6c7-c8c9-cacbcccdce%02x", 0xcf + dev_);
  return kSuccess;
}

NVML_API int nvmlDeviceGetHandleByUUID(const char* uuid, void** h) {
  NVML_GUARD();
  if (!uuid || !h) return kInvalidArgument;
  char buf[96];
  for (int d = 0; d < ndev(); ++d) {
    nvmlDeviceGetUUID(handle_of(d), buf, sizeof(buf));
    if (std::strncmp(buf, uuid, std::strlen(uuid)) == 0) {
      *h = handle_of(d);
      return kSuccess;
    }
  }
  return kNotFound;
}

NVML_API int nvmlDeviceGetHandleByPciBusId_v2(const char* bus, void** h) {
  NVML_GUARD();
  if (!bus || !h) return kInvalidArgument;
  unsigned dom = 0, b = 0;
  if (std::getenv("CUDAEMU_TRACE")) fprintf(stderr, "cudaemu: nvmlDeviceGetHandleByPciBusId_v2(%s)\n", bus);
  if (sscanf(bus, "%x:%x", &dom, &b) != 2 || static_cast<int>(b) - 0x10 >= ndev()) return kNotFound;
  *h = handle_of(static_cast<int>(b) - 0x10);  // cudaDeviceGetPCIBusId: bus 0x10 + device
  return kSuccess;
}

NVML_API int nvmlDeviceGetName(void* h, char* out, unsigned len) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!out || len < 2) return kInsufficientSize;
  snprintf(out, len, "cudaemu (emulated CUDA device %d)", dev_);
  return kSuccess;
}

NVML_API int nvmlDeviceGetTemperature(void* h, int, unsigned* t) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!t) return kInvalidArgument;
  std::lock_guard<std::mutex> g(nv().mu);
  *t = nv().temp;
  return kSuccess;
}

NVML_API int nvmlDeviceGetTotalEccErrors(void* h, int error_type, int counter_type,
                                         unsigned long long* n) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!n) return kInvalidArgument;
  std::lock_guard<std::mutex> g(nv().mu);
  *n = (error_type == 1 && counter_type == 0) ? nv().ecc : 0;  // uncorrected, volatile
  return kSuccess;
}

NVML_API int nvmlDeviceGetRemappedRows(void* h, unsigned* corr, unsigned* unc, unsigned* pending,
                                       unsigned* failure) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!corr || !unc || !pending || !failure) return kInvalidArgument;
  std::lock_guard<std::mutex> g(nv().mu);
  *corr = 0;
  *unc = nv().remap_pending;
  *pending = nv().remap_pending;
  *failure = nv().remap_failure;
  return kSuccess;
}

NVML_API int nvmlDeviceGetCurrentClocksEventReasons(void* h, unsigned long long* r) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!r) return kInvalidArgument;
  std::lock_guard<std::mutex> g(nv().mu);
  *r = nv().clocks;
  return kSuccess;
}
NVML_API int nvmlDeviceGetCurrentClocksThrottleReasons(void* h, unsigned long long* r) {
  return nvmlDeviceGetCurrentClocksEventReasons(h, r);
}

struct FieldValue {
  unsigned fieldId, scopeId;
  long long timestamp, latencyUsec;
  int valueType;
  int nvmlReturn;
  unsigned long long value;
};

NVML_API int nvmlDeviceGetFieldValues(void* h, int count, FieldValue* values) {
  NVML_GUARD();
  NVML_DEV(h);
  if (count < 0 || (count && !values)) return kInvalidArgument;
  std::lock_guard<std::mutex> g(nv().mu);
  for (int i = 0; i < count; ++i) {
    FieldValue& f = values[i];
    f.timestamp = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch()).count();
    f.latencyUsec = 0;
    if (f.fieldId == kFieldRecoveryAction) {
      f.valueType = 1;  // unsigned int
      f.nvmlReturn = kSuccess;
      f.value = static_cast<unsigned long long>(nv().recovery);
    } else {
      f.nvmlReturn = kNotSupported;
      f.value = 0;
    }
  }
  return kSuccess;
}

NVML_API int nvmlEventSetCreate(EventSet** s) {
  NVML_GUARD();
  if (!s) return kInvalidArgument;
  std::lock_guard<std::mutex> g(nv().mu);
  *s = new EventSet();
  nv().sets.push_back(*s);
  return kSuccess;
}

NVML_API int nvmlDeviceRegisterEvents(void* h, unsigned long long types, EventSet* s) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!s) return kInvalidArgument;
  std::lock_guard<std::mutex> g(nv().mu);
  s->registered.emplace_back(dev_, types);
  return kSuccess;
}

NVML_API int nvmlDeviceGetSupportedEventTypes(void* h, unsigned long long* types) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!types) return kInvalidArgument;
  *types = 0x2 | 0x8 | 0x4000 | 0x8000;
  return kSuccess;
}

NVML_API int nvmlEventSetWait_v2(EventSet* s, EventData* out, unsigned timeout_ms) {
  if (!s || !out) return kInvalidArgument;
  Nvml& n = nv();
  std::unique_lock<std::mutex> lk(n.mu);
  if (n.inits <= 0) return kUninitialized;
  n.cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return n.lost || !s->q.empty(); });
  if (n.lost) return kGpuIsLost;
  if (s->q.empty()) return kTimeout;
  *out = s->q.front();
  s->q.pop_front();
  return kSuccess;
}
NVML_API int nvmlEventSetWait(EventSet* s, EventData* out, unsigned timeout_ms) {
  return nvmlEventSetWait_v2(s, out, timeout_ms);
}

NVML_API int nvmlEventSetFree(EventSet* s) {
  if (!s) return kInvalidArgument;
  std::lock_guard<std::mutex> g(nv().mu);
  for (auto it = nv().sets.begin(); it != nv().sets.end(); ++it)
    if (*it == s) {
      nv().sets.erase(it);
      delete s;
      return kSuccess;
    }
  return kInvalidArgument;
}

// torch (c10/cuda/driver_api.cpp) asks for fabric and NVLink facts. Fabric:
// success, state NVML_GPU_FABRIC_STATE_NOT_SUPPORTED (nvmlGpuFabricInfo_v2_t:
// version, clusterUuid[16], status at 20, cliqueId at 24, state at 28).
NVML_API int nvmlDeviceGetGpuFabricInfoV(void* h, unsigned char* info) {
  NVML_GUARD();
  NVML_DEV(h);
  if (!info) return kInvalidArgument;
  std::memset(info + 4, 0, 28);
  return kSuccess;
}
NVML_API int nvmlDeviceGetNvLinkRemoteDeviceType(void*, unsigned, int*) { return kNotSupported; }
NVML_API int nvmlDeviceGetNvLinkRemotePciInfo_v2(void*, unsigned, void*) { return kNotSupported; }
NVML_API int nvmlDeviceGetComputeRunningProcesses(void*, unsigned* n, void*) {
  if (n) *n = 0;
  return kSuccess;
}
