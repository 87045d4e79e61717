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
constexpr uint64_t kStreamMin = 256ull << 10;

void copy_piece(uint8_t* dst, const uint8_t* src, uint64_t n) {
#ifdef CUDASNAP_STREAM_STORES
  if (n >= kStreamMin) {
    const uint64_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const uint64_t body = n & ~uint64_t(63);
    for (uint64_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
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
