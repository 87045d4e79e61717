// Restore from a snapshot file without staging the whole file: read -> verify ->
// scatter, chunk by chunk (issue 26).
//
// read_verify_scatter reads [0, nbytes) of an open regular file in units of
// whole chunks into a small buffer per thread (a few MiB: it stays in the
// cache), checks each chunk's CRC32C against the manifest's table, and only
// then copies the bytes of that chunk which the spans name to their
// destinations (HostSpan: dst address, src_offset = offset in the file, nbytes).
// One pass over the destinations' memory, no buffer of the file's size: the
// old path (read_file_verified into a new buffer, a CRC pass, a scatter copy)
// faulted in and moved every byte twice more.
//
// Guarantees:
//   * every span is checked before the first read (as copy_spans: inside the
//     file, non-null, no wrap-around, no two destinations overlap); a bad one
//     throws a Generic cudasnap::Error and nothing is read or written;
//   * no byte of a chunk reaches a destination before that chunk's CRC32C
//     matched; a chunk that fails stops every thread from claiming more work,
//     the call waits for the chunks in hand on other threads (no write happens
//     after it returns or throws) and throws CorruptSnapshot naming the chunk.
//     Chunks that passed before the failure (on any thread) were copied:
//     ScatterStats::applied_bytes, filled in on success and on failure, says how
//     many bytes (0: the destinations are untouched);
//   * a unit inside the bytes a FileReadAhead (ScatterOptions::ahead) holds of
//     the same file is taken from it, not read again: checked the same way;
//   * the file is fstat'ed first: a non-regular file, or one whose size is not
//     `nbytes`, is CorruptSnapshot before a byte is read; a read that ends early
//     is CorruptSnapshot; a failing read is FlushError (Io).
// The destination addresses themselves cannot be checked here: the caller takes
// them from live contiguous CPU tensors (or a buffer it owns) of >= nbytes.
// No Python: the bindings release the GIL around the call.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "host_copy.h"

namespace cudasnap {

// The head of a snapshot file, read on a thread of its own while the caller
// parses the manifest and plans the copy (which need no byte of the data): the
// restore's disk reads then start with its first Python line instead of after
// them (issue 26). Nothing read here is trusted: read_verify_scatter checks
// every chunk taken from it against the manifest's CRC32C like one it read
// itself, and takes it only if the file it scatters is the one read here
// (same device and inode).
//
// Call order: construct (the thread starts) -> finish() (stops after the
// read in hand, joins; idempotent, from any thread) -> data()/held() ->
// release() (frees the buffer: held() is 0 after it) -> destroy. The destructor
// finishes too, but may then wait for one read with the caller's locks held (the
// bindings' finish()/release() release the GIL): finish first. A failing read,
// or no thread to read with, ends it quietly (error() says why): the scatter
// then reads those bytes itself and reports what it finds.
class FileReadAhead {
 public:
  // Reads [0, min(file size, limit)) of fd in `piece`-byte reads into a buffer
  // of that size. The fd is dup'ed: the caller may close its own at once.
  // A non-regular file, or a size 0, reads nothing.
  FileReadAhead(int fd, uint64_t limit, uint64_t piece = 4ull << 20);
  ~FileReadAhead();
  FileReadAhead(const FileReadAhead&) = delete;
  FileReadAhead& operator=(const FileReadAhead&) = delete;

  // Stops the reader after its current read and waits for it; returns held().
  uint64_t finish();
  // finish(), then frees the buffer (nothing is held after it).
  void release();
  // Bytes [0, held()) of the file are in data() (only after finish()).
  const uint8_t* data() const { return buf_.get(); }
  uint64_t held() const { return got_.load(std::memory_order_acquire); }
  uint64_t target() const { return target_; }  // what it set out to read
  uint64_t dev() const { return dev_; }
  uint64_t ino() const { return ino_; }
  std::string error() const;  // why it stopped short, if it did ("" so far)

 private:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  void run();
  void read_head();

  int fd_ = -1;
  uint64_t target_ = 0;
  uint64_t piece_ = 0;
  uint64_t dev_ = 0, ino_ = 0;
  std::unique_ptr<uint8_t, Free> buf_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> got_{0};
  std::mutex join_mu_;     // finish() from two threads: one joins
  mutable std::mutex mu_;  // error_: the reader writes it, error() may read it meanwhile
  std::string error_;
  std::thread thread_;
};

// Destinations that are not host memory (device memory: csrc/cuda/device_sink.h). With a
// sink, each reader `t` (0 .. threads-1) reads every unit into a buffer the sink hands
// it (page-locked: a copy from it to the device is a DMA that overlaps the next read),
// and a device span's verified bytes are copied by the sink instead of a memcpy.
// Call order, per reader: buffer() -> copy()* -> unit_done(), unit after unit; then, once
// every reader has stopped (also after a failure), drain() on the calling thread.
// buffer() may wait until copies from that buffer's previous unit are done.
struct UnitSink {
  virtual ~UnitSink() = default;
  virtual uint8_t* buffer(int t, uint64_t bytes) = 0;
  virtual void copy(int t, uint64_t dst, const uint8_t* src, uint64_t n) = 0;
  virtual void unit_done(int t) = 0;
  virtual void drain() = 0;
};

struct ScatterOptions {
  int threads = 2;       // readers; each reads, verifies and copies its own units
  uint64_t io_bytes = 0;  // bytes per read: rounded down to whole chunks (0: one chunk)
  bool direct = false;   // O_DIRECT reads (no page cache copy); buffered where refused
  bool sequential = true;  // posix_fadvise(SEQUENTIAL): a larger kernel read-ahead
  // The file's head read already (finished): units wholly inside [0, ahead->held())
  // are verified and copied from it instead of being read. Ignored unless it read
  // the same file (device and inode of fd's fstat).
  FileReadAhead* ahead = nullptr;  // read_verify_scatter finishes it first
  // Spans whose `dst` is a device address, copied by `sink` (checked like host spans:
  // inside the file, no two overlapping); none without a sink.
  const std::vector<HostSpan>* device_spans = nullptr;
  UnitSink* sink = nullptr;
};

struct ScatterStats {
  uint64_t read_bytes = 0;     // file bytes read
  uint64_t applied_bytes = 0;  // bytes copied into the destinations
  uint64_t ahead_bytes = 0;    // bytes taken from ScatterOptions::ahead instead of being read
  int64_t bad_chunk = -1;      // the chunk that failed its CRC32C (the lowest, if several)
  bool direct = false;         // O_DIRECT was in use
  double seconds = 0.0;
};

// See the header comment. `name` is the file's path, for messages only.
// `stats` must not be null; it is filled in whether the call returns or throws.
void read_verify_scatter(int fd, const std::string& name, uint64_t nbytes, uint64_t chunk_bytes,
                         const std::vector<uint32_t>& crcs, const std::vector<HostSpan>& spans,
                         const ScatterOptions& opts, ScatterStats* stats);

}  // namespace cudasnap
