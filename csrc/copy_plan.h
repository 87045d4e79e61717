// Copy plan: the state tensors' byte spans, coalesced into few large copies.
//
// Spans of one phase and one memory space are sorted by address and merged
// when they overlap or lie within `merge_gap` bytes (allocator rounding),
// so a flat parameter buffer or a segment full of parameters becomes one copy.
// Phase 0 (module buffers, written by the next forward) is laid out first, so
// it can be fenced separately from phase 1 (parameters and optimizer state,
// written by the next optimizer step): phase 0 is copied once the chunks that
// overlap [0, phase0_bytes) are.
#pragma once

#include <cstdint>
#include <vector>

namespace cudasnap {

struct TensorSpan {
  uint64_t ptr = 0;     // address of the first byte
  uint64_t nbytes = 0;  // bytes spanned (storage extent of the view)
  int phase = 1;        // 0: fenced at the next forward; 1: at the next optimizer step
  bool host = true;     // host memory (true) or device memory (false)
};

struct PlanRange {
  uint64_t src = 0;
  uint64_t dst = 0;  // offset in the slot's data area
  uint64_t nbytes = 0;
  int phase = 1;
  bool host = true;
};

struct CopyPlan {
  std::vector<PlanRange> ranges;         // sorted by dst
  std::vector<uint64_t> tensor_offsets;  // per input span: offset in the slot
  uint64_t total_bytes = 0;              // data bytes of a snapshot
  uint64_t phase0_bytes = 0;             // end of the phase-0 region
  uint64_t chunk_bytes = 0;
  uint64_t copied_bytes = 0;  // sum of range sizes (>= sum of spans when gaps merged)
  uint64_t num_chunks() const { return (total_bytes + chunk_bytes - 1) / chunk_bytes; }
  uint64_t phase0_chunks() const { return (phase0_bytes + chunk_bytes - 1) / chunk_bytes; }
};

CopyPlan build_plan(const std::vector<TensorSpan>& spans, uint64_t chunk_bytes,
                    uint64_t merge_gap, uint64_t align);
// The same from parallel per-tensor lists (the Python binding's form); throws
// when their lengths differ.
CopyPlan build_plan(const std::vector<uint64_t>& ptrs, const std::vector<uint64_t>& nbytes,
                    const std::vector<int>& phases, const std::vector<bool>& host,
                    uint64_t chunk_bytes, uint64_t merge_gap, uint64_t align);

}  // namespace cudasnap
