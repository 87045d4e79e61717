#include "layout_check.h"

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>

#include "error.h"

namespace cudasnap {

namespace {
uint64_t ptr_of(PyObject* obj, Py_ssize_t i) {
  CUDASNAP_CHECK(THPVariable_Check(obj), "LayoutGuard: item " << i << " is not a tensor");
  return reinterpret_cast<uint64_t>(THPVariable_Unpack(obj).data_ptr());
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

LayoutGuard::~LayoutGuard() { Py_XDECREF(list_); }

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
    auto ii = static_cast<Py_ssize_t>(i);
    if (ptr_of(PyList_GET_ITEM(list_, ii), ii) != ptrs_[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace cudasnap
