#include "flusher.h"

#include <fcntl.h>  // fallocate, sync_file_range (_GNU_SOURCE, set by g++)
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "crc32c.h"
#include "error.h"
#include "test_hooks.h"
#include "thread_pool.h"

namespace cudasnap {
namespace {

std::atomic<int> g_flush_active{0};
std::atomic<uint64_t> g_flush_started{0};
std::atomic<uint64_t> g_bytes_written{0};  // by pwrite_all, as each write returns
std::atomic<uint64_t> g_bytes_read{0};     // by read_file_verified, as each read returns

// Counts a running write_file in g_flush_active for its whole duration.
struct ActiveFlush {
  ActiveFlush() {
    g_flush_started.fetch_add(1, std::memory_order_relaxed);
    g_flush_active.fetch_add(1, std::memory_order_release);
  }
  ~ActiveFlush() { g_flush_active.fetch_sub(1, std::memory_order_release); }
  ActiveFlush(const ActiveFlush&) = delete;
  ActiveFlush& operator=(const ActiveFlush&) = delete;
};

// Reserves [0, n) of fd. The fallocate syscall, not posix_fallocate: where the
// file system has no fallocate, glibc's posix_fallocate emulates it by writing
// one byte into every 4 KiB block, which is a second pass over the file before
// the real one. Returns 0 or an errno; "not supported" is not an error.
int reserve(int fd, uint64_t n) {
  for (;;) {
    if (::fallocate(fd, 0, 0, static_cast<off_t>(n)) == 0) return 0;
    if (errno == EINTR) continue;
    if (errno == EOPNOTSUPP || errno == ENOSYS || errno == EINVAL) return 0;
    return errno;
  }
}

double now_s() { return monotonic_ns() * 1e-9; }

void pwrite_all(int fd, const uint8_t* p, uint64_t n, uint64_t off, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, std::min<uint64_t>(n, 1ull << 30), static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    CUDASNAP_SYSCHECK(w, ErrorKind::Io, "pwrite of " << path << " at offset " << off);
    g_bytes_written.fetch_add(static_cast<uint64_t>(w), std::memory_order_relaxed);
    p += w;
    n -= static_cast<uint64_t>(w);
    off += static_cast<uint64_t>(w);
  }
}

}  // namespace

int flush_active() noexcept { return g_flush_active.load(std::memory_order_acquire); }

bool flush_running() noexcept { return flush_active() > 0; }

void test_flush_active_add(int delta) noexcept {
  g_flush_active.fetch_add(delta, std::memory_order_release);
}

IoBytes io_bytes() noexcept {
  return IoBytes{g_bytes_written.load(std::memory_order_relaxed),
                 g_bytes_read.load(std::memory_order_relaxed)};
}

void count_bytes_read(uint64_t n) noexcept {
  g_bytes_read.fetch_add(n, std::memory_order_relaxed);
}

uint64_t flushes_started() noexcept { return g_flush_started.load(std::memory_order_relaxed); }

void fsync_dir(const std::string& path) {
  int fd = -1;
  CUDASNAP_SYSCHECK(fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC), ErrorKind::Io,
                    "open directory " << path);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  CUDASNAP_SYSCHECK(::fsync(fd), ErrorKind::Io, "fsync directory " << path);
}

FlushStats write_file(const uint8_t* data, uint64_t nbytes, uint64_t chunk_bytes,
                      const std::vector<uint32_t>& expected, const std::string& path,
                      int threads, uint64_t io_bytes, bool durable) {
  CUDASNAP_CHECK(chunk_bytes > 0, "chunk_bytes is 0");
  if (io_bytes < chunk_bytes) io_bytes = chunk_bytes;
  io_bytes = io_bytes / chunk_bytes * chunk_bytes;
  uint64_t nchunks = (nbytes + chunk_bytes - 1) / chunk_bytes;
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, expected.empty() || expected.size() == nchunks,
                      "checksum table has " << expected.size() << " entries for " << nchunks
                                            << " chunks");
  double t0 = now_s();
  FlushStats st;
  st.bytes = nbytes;
  st.crcs.assign(nchunks, 0);
  ActiveFlush active;
  int fd = -1;
  CUDASNAP_SYSCHECK(fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600),
                    ErrorKind::Io, "create " << path);
  try {
    if (nbytes > 0) {
      int rc = reserve(fd, nbytes);
      CUDASNAP_CHECK_KIND(ErrorKind::Io, rc == 0,
                          "cannot reserve " << nbytes << " bytes for " << path
                                            << ": fallocate failed: " << std::strerror(rc)
                                            << " (errno " << rc << ")");
    }
    uint64_t per = io_bytes / chunk_bytes;
    uint64_t pieces = (nchunks + per - 1) / per;
    parallel_for(pieces, threads, [&](uint64_t piece) {
      uint64_t c0 = piece * per, c1 = std::min(nchunks, c0 + per);
      // Re-verify each chunk just before it is written (it is then in cache for the write).
      for (uint64_t c = c0; c < c1; ++c) {
        uint64_t lo = c * chunk_bytes, n = std::min(chunk_bytes, nbytes - lo);
        st.crcs[c] = crc32c(0, data + lo, n);
        CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, expected.empty() || expected[c] == st.crcs[c],
                            "staged snapshot chunk " << c << " (bytes " << lo << ".." << lo + n
                                                     << ") fails its CRC32C before flush to "
                                                     << path);
      }
      uint64_t lo = c0 * chunk_bytes, hi = std::min(nbytes, c1 * chunk_bytes);
      pwrite_all(fd, data + lo, hi - lo, lo, path);
      // Start the device write of this piece now (asynchronous), so the disk works
      // while the other pieces are copied into the page cache; the fdatasync below
      // then waits only for the tail. Without it the kernel starts writeback late
      // (dirty_background thresholds) and the final sync does the whole file.
      if (durable) {
        (void)::sync_file_range(fd, static_cast<off_t>(lo), static_cast<off_t>(hi - lo),
                                SYNC_FILE_RANGE_WRITE);
      }
      if (piece == 0) test_hooks::kill_point("write");
    });
    test_hooks::kill_point("fsync");
    if (durable) {
      double f0 = now_s();
      CUDASNAP_SYSCHECK(::fdatasync(fd), ErrorKind::Io, "fdatasync " << path);
      st.fsync_seconds = now_s() - f0;
    }
    CUDASNAP_SYSCHECK(::close(fd), ErrorKind::Io, "close " << path);
    fd = -1;
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(path.c_str());
    throw;
  }
  st.seconds = now_s() - t0;
  return st;
}

FlushStats write_slot_file(const Arena& arena, int slot, const std::string& path, int threads,
                           uint64_t io_bytes, bool durable) {
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, arena.leases(slot) > 0,
                      "flush of slot " << slot << " without a lease");
  SlotInfo info = arena.slot_info(slot);
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, info.valid,
                      "slot " << slot << " of " << arena.path() << " is not complete"
                              << (info.problem.empty() ? "" : ": " + info.problem));
  return write_file(arena.data(slot), info.data_bytes, arena.chunk_bytes(),
                    arena.read_table(slot), path, threads, io_bytes, durable);
}

double read_file_verified(const std::string& path, uint8_t* dst, uint64_t nbytes,
                          uint64_t chunk_bytes, const std::vector<uint32_t>& crcs, int threads) {
  CUDASNAP_CHECK(chunk_bytes > 0, "chunk_bytes is 0");
  uint64_t nchunks = (nbytes + chunk_bytes - 1) / chunk_bytes;
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, crcs.size() == nchunks,
                      path << ": manifest lists " << crcs.size() << " chunk checksums for "
                           << nchunks << " chunks");
  double t0 = now_s();
  // O_NOFOLLOW/O_NONBLOCK + S_ISREG: a symlink, FIFO or device planted as data.bin is
  // refused without reading a byte outside the snapshot (or blocking on a FIFO).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0 && errno == ELOOP) {
    CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, false, path << " is a symbolic link; refusing it");
  }
  if (fd < 0) {
    int err = errno;
    CUDASNAP_CHECK_KIND(ErrorKind::Io, false, "open(O_RDONLY|O_NOFOLLOW) of " << path << " failed: "
                                                 << std::strerror(err) << " (errno " << err
                                                 << ")");
  }
  struct stat st {};
  if (::fstat(fd, &st) == 0 && !S_ISREG(st.st_mode)) {
    ::close(fd);
    CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, false, path << " is not a regular file");
  }
  if (::fstat(fd, &st) < 0 || static_cast<uint64_t>(st.st_size) != nbytes) {
    uint64_t size = static_cast<uint64_t>(st.st_size);
    ::close(fd);
    CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, false,
                        path << " is " << size << " bytes, the manifest says " << nbytes
                             << " (truncated or replaced)");
  }
  try {
    parallel_for(nchunks, threads, [&](uint64_t c) {
      uint64_t lo = c * chunk_bytes, n = std::min(chunk_bytes, nbytes - lo), got = 0;
      while (got < n) {
        ssize_t r = ::pread(fd, dst + lo + got, n - got, static_cast<off_t>(lo + got));
        if (r < 0 && errno == EINTR) continue;
        CUDASNAP_SYSCHECK(r, ErrorKind::Io, "pread of " << path << " at offset " << lo + got);
        CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, r > 0,
                            path << " ended early at offset " << lo + got);
        got += static_cast<uint64_t>(r);
        g_bytes_read.fetch_add(static_cast<uint64_t>(r), std::memory_order_relaxed);
      }
      uint32_t crc = crc32c(0, dst + lo, n);
      CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, crc == crcs[c],
                          path << ": chunk " << c << " (bytes " << lo << ".." << lo + n
                               << ") fails its CRC32C (stored " << crcs[c] << ", read " << crc
                               << ")");
    });
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return now_s() - t0;
}

int64_t verify_buffer(const uint8_t* data, uint64_t nbytes, uint64_t chunk_bytes,
                      const std::vector<uint32_t>& crcs, int threads) {
  CUDASNAP_CHECK(chunk_bytes > 0, "chunk_bytes is 0");
  uint64_t nchunks = (nbytes + chunk_bytes - 1) / chunk_bytes;
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, crcs.size() == nchunks,
                      "checksum table has " << crcs.size() << " entries for " << nchunks
                                            << " chunks");
  std::atomic<int64_t> bad{-1};
  parallel_for(nchunks, threads, [&](uint64_t c) {
    uint64_t lo = c * chunk_bytes, n = std::min(chunk_bytes, nbytes - lo);
    if (crc32c(0, data + lo, n) != crcs[c]) {
      int64_t cur = bad.load();
      while ((cur < 0 || int64_t(c) < cur) && !bad.compare_exchange_weak(cur, int64_t(c))) {
      }
    }
  });
  return bad.load();
}

}  // namespace cudasnap
