#include "host_copy.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "error.h"
#include "thread_pool.h"

namespace cudasnap {
namespace {

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
    std::memcpy(reinterpret_cast<uint8_t*>(s.dst) + pc.offset, src + s.src_offset + pc.offset,
                pc.nbytes);
  });
  return total;
}

}  // namespace cudasnap
