#include "layout_check.h"

#include <algorithm>

#include "../error.h"
#include "restore_spans.h"  // tensor_object_ptr: keeps torch's Python headers out of this file

namespace cudasnap {

namespace {
uint64_t ptr_of(PyObject* obj, Py_ssize_t i) {
  CUDASNAP_CHECK(is_tensor_object(obj), "LayoutGuard: item " << i << " is not a tensor");
  return tensor_object_ptr(obj);
}
}  // namespace

LayoutGuard::LayoutGuard(PyObject* tensors) {
  CUDASNAP_CHECK(PyList_Check(tensors), "LayoutGuard expects a list of tensors");
  list_ = PyList_GetSlice(tensors, 0, PyList_GET_SIZE(tensors));
  CUDASNAP_CHECK(list_ != nullptr, "LayoutGuard: cannot copy the tensor list");
  Py_ssize_t n = PyList_GET_SIZE(list_);
  ptrs_.reserve(static_cast<size_t>(n));
  try {
    for (Py_ssize_t i = 0; i < n; ++i) ptrs_.push_back(ptr_of(PyList_GET_ITEM(list_, i), i));
  } catch (...) {
    Py_DECREF(list_);
    throw;
  }
}

LayoutGuard::~LayoutGuard() {
  Py_XDECREF(list_);
  Py_XDECREF(entries_);
  Py_XDECREF(owners_);
  Py_XDECREF(size_attr_);
}

namespace {
// len(getattr(owner, attr)), or -1 when that fails.
Py_ssize_t size_of(PyObject* owner, PyObject* attr) {
  PyObject* v = PyObject_GetAttr(owner, attr);  // new reference
  Py_ssize_t n = v == nullptr ? -1 : PyObject_Size(v);
  if (n < 0) PyErr_Clear();
  Py_XDECREF(v);
  return n;
}
}  // namespace

void LayoutGuard::set_sizes(PyObject* owners, PyObject* attr) {
  CUDASNAP_CHECK(PyList_Check(owners) && PyUnicode_Check(attr),
                 "LayoutGuard.set_sizes expects a list and an attribute name");
  PyObject* copy = PyList_GetSlice(owners, 0, PyList_GET_SIZE(owners));
  CUDASNAP_CHECK(copy != nullptr, "LayoutGuard: cannot copy the owner list");
  Py_XDECREF(owners_);
  Py_XDECREF(size_attr_);
  owners_ = copy;
  Py_INCREF(attr);
  size_attr_ = attr;
  sizes_.clear();
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(owners_); ++i)
    sizes_.push_back(size_of(PyList_GET_ITEM(owners_, i), size_attr_));
}

bool LayoutGuard::sizes_changed() const {
  if (owners_ == nullptr) return false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(owners_); ++i) {
    Py_ssize_t n = size_of(PyList_GET_ITEM(owners_, i), size_attr_);
    if (n < 0 || n != sizes_[static_cast<size_t>(i)]) return true;
  }
  return false;
}

void LayoutGuard::set_rescan_every(int64_t n) {
  CUDASNAP_CHECK(n >= 1, "LayoutGuard: rescan period must be >= 1, got " << n);
  rescan_every_ = n;
}

int LayoutGuard::boundary_check(int64_t count) {
  if (sizes_changed()) return 1;
  ++checks_;
  if (entries_changed(count) || check_next(count) >= 0) return 1;
  return rescan_every_ > 0 && checks_ % rescan_every_ == 0 ? 2 : 0;
}

void LayoutGuard::set_entries(PyObject* entries) {
  CUDASNAP_CHECK(PyList_Check(entries), "LayoutGuard.set_entries expects a list");
  Py_ssize_t n = PyList_GET_SIZE(entries);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* e = PyList_GET_ITEM(entries, i);
    CUDASNAP_CHECK(PyTuple_Check(e) && PyTuple_GET_SIZE(e) == 3,
                   "LayoutGuard.set_entries: item " << i << " is not a (container, key, object) tuple");
  }
  PyObject* copy = PyList_GetSlice(entries, 0, n);
  CUDASNAP_CHECK(copy != nullptr, "LayoutGuard: cannot copy the entry list");
  Py_XDECREF(entries_);
  entries_ = copy;
  entry_cursor_ = 0;
}

bool LayoutGuard::entries_changed(int64_t count) {
  const size_t n = num_entries();
  if (n == 0 || count <= 0) return false;
  const size_t todo = std::min(n, static_cast<size_t>(count));
  for (size_t k = 0; k < todo; ++k) {
    PyObject* e = PyList_GET_ITEM(entries_, static_cast<Py_ssize_t>(entry_cursor_));
    PyObject* d = PyTuple_GET_ITEM(e, 0);
    PyObject* key = PyTuple_GET_ITEM(e, 1);
    PyObject* want = PyTuple_GET_ITEM(e, 2);
    bool same;
    if (PyDict_CheckExact(d)) {
      PyObject* got = PyDict_GetItemWithError(d, key);  // borrowed
      if (got == nullptr && PyErr_Occurred()) PyErr_Clear();  // unhashable: counts as changed
      same = got == want;
    } else {  // another mapping: its own __getitem__
      PyObject* got = PyObject_GetItem(d, key);  // new reference
      if (got == nullptr) PyErr_Clear();
      same = got == want;
      Py_XDECREF(got);
    }
    if (!same) return true;  // the cursor stays: the entry is reported again until rebuilt
    entry_cursor_ = (entry_cursor_ + 1) % n;
  }
  return false;
}

int64_t LayoutGuard::first_moved() const {
  Py_ssize_t n = PyList_GET_SIZE(list_);
  for (Py_ssize_t i = 0; i < n; ++i)
    if (ptr_of(PyList_GET_ITEM(list_, i), i) != ptrs_[static_cast<size_t>(i)]) return i;
  return -1;
}

int64_t LayoutGuard::check_next(int64_t count) {
  const size_t n = ptrs_.size();
  if (n == 0 || count <= 0) return -1;
  const size_t todo = std::min(n, static_cast<size_t>(count));
  for (size_t k = 0; k < todo; ++k) {
    size_t i = cursor_;
    cursor_ = (cursor_ + 1) % n;
    // The private list holds the objects checked to be tensors at construction (a
    // tensor's __class__ cannot become a non-tensor one): no isinstance check here.
    PyObject* t = PyList_GET_ITEM(list_, static_cast<Py_ssize_t>(i));
    if (tensor_object_ptr(t) != ptrs_[i])
      return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace cudasnap
