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
//   * the file is fstat'ed first: a non-regular file, or one whose size is not
//     `nbytes`, is CorruptSnapshot before a byte is read; a read that ends early
//     is CorruptSnapshot; a failing read is FlushError (Io).
// The destination addresses themselves cannot be checked here: the caller takes
// them from live contiguous CPU tensors (or a buffer it owns) of >= nbytes.
// No Python: the bindings release the GIL around the call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "host_copy.h"

namespace cudasnap {

struct ScatterOptions {
  int threads = 2;       // readers; each reads, verifies and copies its own units
  uint64_t io_bytes = 0;  // bytes per read: rounded down to whole chunks (0: one chunk)
  bool direct = false;   // O_DIRECT reads (no page cache copy); buffered where refused
  bool sequential = true;  // posix_fadvise(SEQUENTIAL): a larger kernel read-ahead
};

struct ScatterStats {
  uint64_t read_bytes = 0;     // file bytes read
  uint64_t applied_bytes = 0;  // bytes copied into the destinations
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
