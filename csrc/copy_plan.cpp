#include "copy_plan.h"

#include <algorithm>
#include <numeric>

#include "error.h"

namespace cudasnap {
namespace {
uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
constexpr uint64_t kElemAlign = 16;
}  // namespace

CopyPlan build_plan(const std::vector<TensorSpan>& spans, uint64_t chunk_bytes,
                    uint64_t merge_gap, uint64_t align) {
  CUDASNAP_CHECK(chunk_bytes > 0 && align > 0 && chunk_bytes % align == 0,
                 "chunk_bytes (" << chunk_bytes << ") must be a multiple of align (" << align
                                 << ")");
  CopyPlan plan;
  plan.chunk_bytes = chunk_bytes;
  plan.tensor_offsets.assign(spans.size(), 0);
  uint64_t cursor = 0;
  const uint64_t range_align = std::lcm(align, kElemAlign);  // ranges start 16-aligned
  for (int phase = 0; phase <= 1; ++phase) {
    for (int space = 0; space <= 1; ++space) {  // device spans first, then host
      bool host = space == 1;
      std::vector<size_t> idx;
      for (size_t i = 0; i < spans.size(); ++i) {
        const TensorSpan& s = spans[i];
        CUDASNAP_CHECK(s.phase == 0 || s.phase == 1,
                       "span " << i << " has phase " << s.phase << " (0 or 1 expected)");
        if (s.phase == phase && s.host == host && s.nbytes > 0) idx.push_back(i);
      }
      std::sort(idx.begin(), idx.end(),
                [&](size_t a, size_t b) { return spans[a].ptr < spans[b].ptr; });
      size_t k = 0;
      while (k < idx.size()) {
        uint64_t gs = spans[idx[k]].ptr;
        uint64_t ge = gs + spans[idx[k]].nbytes;
        size_t first = k++;
        // Device spans merge only when they strictly overlap (views of one
        // storage): two allocations may lie back to back in the address space,
        // and one cudaMemcpyAsync across their boundary reads memory that can
        // be freed or unmapped under the copy. Same-segment coalescing of device
        // spans is done before this, by the allocator registry. Host spans may
        // also merge across gaps up to merge_gap.
        auto joins = [&](const TensorSpan& s) {
          return host ? s.ptr <= ge + merge_gap : s.ptr < ge;
        };
        while (k < idx.size() && joins(spans[idx[k]])) {
          ge = std::max(ge, spans[idx[k]].ptr + spans[idx[k]].nbytes);
          ++k;
        }
        // Start the copy on a 16-byte boundary (the largest element size): every
        // tensor's offset then keeps its address's alignment, so a view that is
        // aligned for its dtype stays aligned in the slot even when the group
        // starts with a less aligned tensor (mixed-dtype views of one storage).
        // The <= 15 extra bytes lie in the same page / allocator block.
        gs -= gs % kElemAlign;
        uint64_t dst = round_up(cursor, range_align);
        PlanRange r;
        r.src = gs;
        r.dst = dst;
        r.nbytes = ge - gs;
        r.phase = phase;
        r.host = host;
        plan.ranges.push_back(r);
        plan.copied_bytes += r.nbytes;
        for (size_t j = first; j < k; ++j)
          plan.tensor_offsets[idx[j]] = dst + (spans[idx[j]].ptr - gs);
        cursor = dst + r.nbytes;
      }
    }
    if (phase == 0) {
      cursor = round_up(cursor, align);
      plan.phase0_bytes = cursor;
    }
  }
  plan.total_bytes = cursor;
  return plan;
}

CopyPlan build_plan(const std::vector<uint64_t>& ptrs, const std::vector<uint64_t>& nbytes,
                    const std::vector<int>& phases, const std::vector<bool>& host,
                    uint64_t chunk_bytes, uint64_t merge_gap, uint64_t align) {
  CUDASNAP_CHECK(ptrs.size() == nbytes.size() && ptrs.size() == phases.size() &&
                     ptrs.size() == host.size(),
                 "build_plan: ptrs, nbytes, phases and host differ in length");
  std::vector<TensorSpan> spans(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) spans[i] = {ptrs[i], nbytes[i], phases[i], host[i]};
  return build_plan(spans, chunk_bytes, merge_gap, align);
}

}  // namespace cudasnap
