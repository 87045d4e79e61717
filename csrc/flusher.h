// Flusher: moves a COMPLETE arena slot (or any buffer) to a durable file, and
// reads such files back with every chunk's CRC32C verified.
//
// write_slot_file: several threads pwrite large chunk-aligned pieces straight
// from the mapped slot, re-verifying each chunk's CRC32C against the slot's
// table first (shared memory is not trusted blindly), reserve the space with
// fallocate up front (a full disk fails before any byte is written), then
// fdatasync (each piece's writeback is started with sync_file_range as soon as it
// is written, so the final fdatasync waits for the tail only). The directory protocol (tmp dir, manifest, fsync, rename, latest)
// is in cudasnap/storage/posix.py on top of this.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "staging.h"

namespace cudasnap {

struct FlushStats {
  uint64_t bytes = 0;
  double seconds = 0.0;       // whole call
  double fsync_seconds = 0.0;  // part spent in fdatasync
  std::vector<uint32_t> crcs;  // per chunk
};

// Writes `nbytes` from `data` to `path` (created 0600, must not exist) using
// `threads` writers and `io_bytes` per write (a multiple of chunk_bytes).
// When `expected` is non-empty every chunk's CRC32C is checked first; a
// mismatch throws CorruptSnapshot naming the chunk. Returns the chunk CRCs.
FlushStats write_file(const uint8_t* data, uint64_t nbytes, uint64_t chunk_bytes,
                      const std::vector<uint32_t>& expected, const std::string& path,
                      int threads, uint64_t io_bytes, bool durable);

FlushStats write_slot_file(const Arena& arena, int slot, const std::string& path, int threads,
                           uint64_t io_bytes, bool durable);

// Reads `nbytes` of `path` into `dst`, checking each chunk's CRC32C.
// Throws CorruptSnapshot naming the file and chunk on a mismatch, or on a short file.
double read_file_verified(const std::string& path, uint8_t* dst, uint64_t nbytes,
                          uint64_t chunk_bytes, const std::vector<uint32_t>& crcs, int threads);

// Verifies a buffer against chunk CRCs; returns the first bad chunk or -1.
int64_t verify_buffer(const uint8_t* data, uint64_t nbytes, uint64_t chunk_bytes,
                      const std::vector<uint32_t>& crcs, int threads);

// Number of write_file / write_slot_file calls running now in this process
// (an atomic load, cheap enough for a copy loop to poll per chunk), and how
// many have started since load. A copy engine that sees flush_active() > 0
// should yield the disk-feeding CPU and memory bandwidth to the flush.
int flush_active() noexcept;
uint64_t flushes_started() noexcept;
// flush_active() > 0: the copy engines' yield predicate (BatchOptions::should_yield
// in thread_pool.h), so that their batches yield to a flush in this process.
bool flush_running() noexcept;
// Bytes the flusher has written to files (write_file, write_slot_file) and
// read back (read_file_verified) in this process since load, counted as each
// system call returns: monotonic, cheap to poll (progress bars), and unlike
// /proc/self/io blind to every other thread's I/O.
struct IoBytes {
  uint64_t written = 0;
  uint64_t read = 0;
};
IoBytes io_bytes() noexcept;
// Adds n to io_bytes().read: other readers of snapshot files (file_restore.h) count there too.
void count_bytes_read(uint64_t n) noexcept;

// TEST-ONLY: adds `delta` to the flush_active() count (a flush "running" for
// as long as a test holds it), so copy engines' yielding is testable.
void test_flush_active_add(int delta) noexcept;

// fsync of a directory (after creating or renaming entries in it).
void fsync_dir(const std::string& path);

}  // namespace cudasnap
