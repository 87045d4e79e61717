// Layout check: has any registered state tensor moved since the copy plan was built?
//
// Called at every boundary, so it must cost nanoseconds per tensor: it reads
// each tensor's data pointer through the C++ tensor behind the Python object
// instead of one Python method call per tensor.
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

namespace cudasnap {

// Holds references to the state tensors and their data pointers at plan time.
class LayoutGuard {
 public:
  explicit LayoutGuard(PyObject* tensors);  // a Python list of torch.Tensor
  ~LayoutGuard();
  LayoutGuard(const LayoutGuard&) = delete;
  LayoutGuard& operator=(const LayoutGuard&) = delete;
  // Index of the first tensor whose data pointer changed, or -1.
  int64_t first_moved() const;
  // Checks the next `count` tensors after the last checked one (wrapping), so a
  // boundary costs O(count) whatever the tensor count; every tensor is checked
  // once per ceil(size / count) calls. Index of a moved tensor, or -1.
  int64_t check_next(int64_t count);
  size_t size() const { return ptrs_.size(); }

 private:
  PyObject* list_;  // owned reference (a private copy of the list)
  std::vector<uint64_t> ptrs_;
  size_t cursor_ = 0;
};

}  // namespace cudasnap
