// Multi-threaded host-to-host copy of byte spans out of one source buffer.
//
// Restore's hot path: a verified snapshot (an arena slot in /dev/shm, or a
// buffer read from disk) is copied into the contiguous CPU tensors of the live
// model and optimizer. One span per tensor: `nbytes` bytes from
// src + src_offset to dst. Spans are cut into pieces of at most `piece_bytes`
// (a big tensor splits across threads) and run on parallel_for (thread_pool.h);
// on x86-64 a piece of >= 64 KiB is written with non-temporal (streaming)
// stores, as glibc's memcpy does only for single copies larger than most caches.
//
// Every span is checked before any byte is written (a Generic cudasnap::Error,
// SnapshotError in Python, naming the span and its bytes):
//   * its source range lies inside [src, src + src_bytes);
//   * dst is not null, dst + nbytes does not wrap around;
//   * its destination does not overlap the source buffer or another span's
//     destination (the pieces run in any order on any thread).
// Only the destination pointers themselves cannot be checked: the caller takes
// them from live tensors (data_ptr() of a contiguous tensor of >= nbytes).
#pragma once

#include <cstdint>
#include <vector>

namespace cudasnap {

struct HostSpan {
  uint64_t dst = 0;         // destination address
  uint64_t src_offset = 0;  // offset in the source buffer
  uint64_t nbytes = 0;
};

constexpr uint64_t kHostCopyPiece = 8ull << 20;

// Copies n bytes (not overlapping) the way copy_spans copies a piece: from 64 KiB on with
// streaming stores (x86-64), below that with memcpy. No checks.
void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t n);

// Throws cudasnap::Error (Generic) when a span is bad; nothing is copied then.
// Returns the bytes copied.
uint64_t copy_spans(const uint8_t* src, uint64_t src_bytes, const std::vector<HostSpan>& spans,
                    int threads, uint64_t piece_bytes = kHostCopyPiece);

}  // namespace cudasnap
