// Layout check: has any registered state tensor moved since the copy plan was built?
//
// Called at every boundary, so it must cost nanoseconds per tensor: it reads
// each tensor's data pointer through the C++ tensor behind the Python object
// instead of one Python method call per tensor, and the container identity
// entries (is `opt.state[p]["exp_avg"]` still the planned tensor?) by direct
// dict lookups instead of a Python loop.
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
  // Container identity entries: a Python list of (container, key, expected object)
  // tuples (the dicts that hold the state tensors). Replaces the previous list.
  void set_entries(PyObject* entries);
  // Checks the next `count` entries (wrapping): true when one no longer holds its
  // expected object (`container[key] is not expected`, or the key is gone).
  bool entries_changed(int64_t count);
  size_t num_entries() const { return entries_ ? static_cast<size_t>(PyList_GET_SIZE(entries_)) : 0; }
  // One boundary's check in one call: `count` pointers and `count` entries.
  bool window_changed(int64_t count) { return entries_changed(count) || check_next(count) >= 0; }
  // The state's signature: len(getattr(owner, attr)) of each owner in a Python list
  // (len(opt.state) per optimizer: it grows on lazy init), remembered as of now.
  void set_sizes(PyObject* owners, PyObject* attr);
  bool sizes_changed() const;
  // A boundary's whole layout check in one call: the signature, then the next `count`
  // identity entries and `count` data pointers. 1: stale (rebuild the plan); 2: fresh,
  // but a full re-scan is due (every `rescan_every`-th fresh check); 0: fresh.
  int boundary_check(int64_t count);
  void set_rescan_every(int64_t n);
  int64_t checks() const { return checks_; }

 private:
  PyObject* list_;  // owned reference (a private copy of the list)
  std::vector<uint64_t> ptrs_;
  size_t cursor_ = 0;
  PyObject* entries_ = nullptr;  // owned reference (a private copy of the list)
  size_t entry_cursor_ = 0;
  PyObject* owners_ = nullptr;  // owned reference (a private copy of the list)
  PyObject* size_attr_ = nullptr;
  std::vector<Py_ssize_t> sizes_;
  int64_t rescan_every_ = 0;
  int64_t checks_ = 0;
};

}  // namespace cudasnap
