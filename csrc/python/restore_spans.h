// Restore's copy plan, from Python objects: which (live tensor, snapshot value)
// pairs are plain byte copies, without a Python call per tensor.
//
// The rules are those of cudasnap/core/copy_back.py (byte_span, _overlapping),
// which stays the reference: a pair is a byte copy when
//   * the destination's type is exactly one of `plain_types` (torch.Tensor,
//     torch.nn.Parameter), on the CPU, strided, contiguous, not an inference
//     tensor, no conjugate or negative bit, of more than 0 bytes;
//   * the source is either a manifest entry (a dict with dtype, shape, stride,
//     offset, already validated by format/manifest.py) whose view of the buffer
//     is contiguous, or a tensor of exactly `src_type` (torch.Tensor), on the
//     CPU, contiguous, no conjugate or negative bit, inside [lo, lo + size);
//   * both have the same dtype and shape, and the source bytes lie in the buffer;
//   * its destination overlaps no other pair's destination (such groups keep
//     torch's sequential copy_, so the result never depends on the copy order).
// Everything else is left to the caller (torch copy_).
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

#include "../host_copy.h"

namespace cudasnap {

// Whether `obj` is a torch tensor (THPVariable_Check), and a tensor object's data
// pointer. Here, not in layout_check.cpp: torch's python_variable.h is ~9 s of parsing
// per file that includes it (layout_check.cpp: 21 -> 1.4 CPU-s to compile).
bool is_tensor_object(PyObject* obj);
uint64_t tensor_object_ptr(PyObject* obj);

struct RestorePlan {
  std::vector<HostSpan> spans;   // the byte copies
  std::vector<PyObject*> dsts;   // their destination tensors (borrowed from the caller's list)
  std::vector<int64_t> slow;     // indices of the pairs left to torch's copy_
};

// dsts, srcs: Python lists of equal length. dtypes: {manifest dtype name: torch.dtype}.
// plain_types: a tuple of the accepted destination types; src_type: the accepted
// source tensor type. lo/size: the snapshot buffer (lo == 0: no byte copies).
// Needs the GIL. Throws cudasnap::Error on malformed arguments.
RestorePlan plan_restore(PyObject* dsts, PyObject* srcs, PyObject* dtypes, PyObject* plain_types,
                         PyObject* src_type, uint64_t lo, uint64_t size);

// Marks each planned destination as modified in place (autograd's version counter),
// what torch's copy_ does. Needs the GIL.
void bump_versions(const RestorePlan& plan);

}  // namespace cudasnap
