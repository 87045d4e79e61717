// Error handling for the cudasnap engine.
//
// Every failing check throws cudasnap::Error carrying a kind, the source file,
// the line and the failing expression or call. python/bindings.cpp maps the kinds
// to the Python hierarchy in cudasnap/errors.py (SnapshotError and subclasses).
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace cudasnap {

enum class ErrorKind {
  Generic,       // cudasnap.SnapshotError
  Staging,       // cudasnap.StagingError: shared-memory arena problems
  Corrupt,       // cudasnap.CorruptSnapshot: checksum / header mismatch
  Incompatible,  // cudasnap.IncompatibleSnapshot: layout or version mismatch
  Io,            // cudasnap.FlushError: file-system failures
  Cuda,          // cudasnap.CudaError: a CUDA runtime call failed
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what)
      : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line,
                              const std::string& what);

}  // namespace cudasnap

#define CUDASNAP_CHECK_KIND(kind, cond, msg)                                  \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::ostringstream cudasnap_os_;                                        \
      cudasnap_os_ << msg;                                                    \
      ::cudasnap::throw_error((kind), __FILE__, __LINE__,                     \
                              cudasnap_os_.str() + " [check: " #cond "]");   \
    }                                                                         \
  } while (0)

#define CUDASNAP_CHECK(cond, msg) \
  CUDASNAP_CHECK_KIND(::cudasnap::ErrorKind::Generic, cond, msg)

// For POSIX calls returning -1 and setting errno.
#define CUDASNAP_SYSCHECK(call, kind, msg)                                    \
  do {                                                                        \
    if ((call) < 0) {                                                         \
      int cudasnap_err_ = errno;                                              \
      std::ostringstream cudasnap_os_;                                        \
      cudasnap_os_ << msg << ": " #call " failed: " << std::strerror(cudasnap_err_) \
                   << " (errno " << cudasnap_err_ << ")";                    \
      ::cudasnap::throw_error((kind), __FILE__, __LINE__, cudasnap_os_.str()); \
    }                                                                         \
  } while (0)

#ifdef CUDASNAP_WITH_CUDA
#include <cuda_runtime_api.h>
#define CUDASNAP_CUDA_CHECK(call)                                             \
  do {                                                                        \
    cudaError_t cudasnap_st_ = (call);                                        \
    if (cudasnap_st_ != cudaSuccess) {                                        \
      /* Clear the runtime's per-thread "last error" so that torch does not   \
         report this (non-sticky) failure later against an unrelated kernel; \
         a sticky error (context lost) cannot be cleared and stays visible. */ \
      (void)cudaGetLastError();                                               \
      int cudasnap_dev_ = -1;                                                 \
      (void)cudaGetDevice(&cudasnap_dev_);                                    \
      std::ostringstream cudasnap_os_;                                        \
      cudasnap_os_ << #call " failed on device " << cudasnap_dev_ << ": "    \
                   << cudaGetErrorName(cudasnap_st_) << ": "                 \
                   << cudaGetErrorString(cudasnap_st_);                      \
      ::cudasnap::throw_error(::cudasnap::ErrorKind::Cuda, __FILE__, __LINE__, \
                              cudasnap_os_.str());                            \
    }                                                                         \
  } while (0)
#endif
