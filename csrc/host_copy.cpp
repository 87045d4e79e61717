#include "host_copy.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "error.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define CUDASNAP_STREAM_STORES 1
#endif

namespace cudasnap {
namespace {

// A big piece goes to memory with non-temporal stores: the destination lines
// are not read first (a plain copy's read-for-ownership is a third memory
// transfer per line) and do not evict the cache. glibc's memcpy does the same
// only above ~3/4 of the last-level cache per call, which our pieces are not.
// From 64 KiB on: restore's 4,000 tensors of 125 KB copy ~1.3x faster than with memcpy.
constexpr uint64_t kStreamMin = 64ull << 10;

#ifdef CUDASNAP_STREAM_STORES
// 64 bytes from src to dst (dst 16-byte aligned) with streaming stores.
inline void stream64(uint8_t* dst, const uint8_t* src) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
  const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
}

// Blocks of 4 pages are copied 128 bytes of each page in turn (glibc's
// large_memcpy_4x pattern): four read and four write streams at once keep more
// DRAM pages open than one long stream, ~25% faster than a straight streaming
// loop (and than glibc's whole-buffer memcpy) on the 2-core VM of bench/RESULTS.md.
constexpr uint64_t kPageBytes = 4096;
constexpr uint64_t kBlock = 4 * kPageBytes;
#endif

void copy_piece(uint8_t* dst, const uint8_t* src, uint64_t n) {
#ifdef CUDASNAP_STREAM_STORES
  if (n >= kStreamMin) {
    // Whole cache lines only: a partly written line defeats the streaming store.
    const uint64_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const uint64_t blocks = n / kBlock * kBlock;
    for (uint64_t o = 0; o < blocks; o += kBlock) {
      for (uint64_t i = 0; i < kPageBytes; i += 128) {
        for (uint64_t k = 0; k < kBlock; k += kPageBytes) {
          const uint8_t* s = src + o + k + i;
          _mm_prefetch(reinterpret_cast<const char*>(s + 256), _MM_HINT_T0);
          stream64(dst + o + k + i, s);
          stream64(dst + o + k + i + 64, s + 64);
        }
      }
    }
    const uint64_t body = blocks + (n - blocks) / 64 * 64;
    for (uint64_t i = blocks; i < body; i += 64) stream64(dst + i, src + i);
    _mm_sfence();  // the streamed lines are visible before the batch reports done
    std::memcpy(dst + body, src + body, n - body);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

struct Piece {
  uint64_t span;
  uint64_t offset;  // within the span
  uint64_t nbytes;
};

struct DstRange {
  uint64_t lo;
  uint64_t hi;
  uint64_t span;
};

}  // namespace

void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t n) { copy_piece(dst, src, n); }

uint64_t copy_spans(const uint8_t* src, uint64_t src_bytes, const std::vector<HostSpan>& spans,
                    int threads, uint64_t piece_bytes) {
  CUDASNAP_CHECK(piece_bytes > 0, "copy_spans: piece size is 0");
  CUDASNAP_CHECK(src != nullptr || src_bytes == 0,
                 "copy_spans: null source buffer of " << src_bytes << " bytes");
  const uint64_t src_lo = reinterpret_cast<uint64_t>(src);
  CUDASNAP_CHECK(src_bytes <= std::numeric_limits<uint64_t>::max() - src_lo,
                 "copy_spans: source buffer of " << src_bytes << " bytes wraps around");
  const uint64_t src_hi = src_lo + src_bytes;

  // Every check before the first byte moves: a bad span leaves the destinations untouched.
  std::vector<DstRange> dsts;
  dsts.reserve(spans.size());
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (uint64_t i = 0; i < spans.size(); ++i) {
    const HostSpan& s = spans[i];
    if (s.nbytes == 0) continue;
    CUDASNAP_CHECK(s.src_offset <= src_bytes && s.nbytes <= src_bytes - s.src_offset,
                   "copy_spans: span " << i << " reads bytes [" << s.src_offset << ", "
                                       << s.src_offset << " + " << s.nbytes
                                       << ") outside the source buffer of " << src_bytes
                                       << " bytes");
    CUDASNAP_CHECK(s.dst != 0, "copy_spans: span " << i << " has a null destination");
    CUDASNAP_CHECK(s.nbytes <= std::numeric_limits<uint64_t>::max() - s.dst,
                   "copy_spans: span " << i << " destination of " << s.nbytes
                                       << " bytes wraps around");
    const uint64_t lo = s.dst, hi = s.dst + s.nbytes;
    CUDASNAP_CHECK(hi <= src_lo || lo >= src_hi,
                   "copy_spans: span " << i << " destination overlaps the source buffer");
    dsts.push_back({lo, hi, i});
    for (uint64_t off = 0; off < s.nbytes; off += piece_bytes)
      pieces.push_back({i, off, std::min(piece_bytes, s.nbytes - off)});
    total += s.nbytes;
  }
  std::sort(dsts.begin(), dsts.end(),
            [](const DstRange& a, const DstRange& b) { return a.lo < b.lo; });
  for (uint64_t k = 1; k < dsts.size(); ++k) {
    CUDASNAP_CHECK(dsts[k].lo >= dsts[k - 1].hi,
                   "copy_spans: destinations of spans " << dsts[k - 1].span << " and "
                                                        << dsts[k].span << " overlap");
  }
  if (pieces.empty()) return 0;
  parallel_for(pieces.size(), threads, [&](uint64_t p) {
    const Piece& pc = pieces[p];
    const HostSpan& s = spans[pc.span];
    copy_piece(reinterpret_cast<uint8_t*>(s.dst) + pc.offset, src + s.src_offset + pc.offset,
               pc.nbytes);
  });
  return total;
}

}  // namespace cudasnap
