#include "restore_spans.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "../error.h"

namespace cudasnap {

bool is_tensor_object(PyObject* obj) { return THPVariable_Check(obj); }

uint64_t tensor_object_ptr(PyObject* obj) {
  return reinterpret_cast<uint64_t>(THPVariable_Unpack(obj).data_ptr());
}
namespace {

// The entry keys, made once (interned: a dict lookup compares pointers first).
struct Keys {
  PyObject* dtype = PyUnicode_InternFromString("dtype");
  PyObject* shape = PyUnicode_InternFromString("shape");
  PyObject* stride = PyUnicode_InternFromString("stride");
  PyObject* offset = PyUnicode_InternFromString("offset");
  PyObject* nbytes = PyUnicode_InternFromString("nbytes");
};

const Keys& keys() {
  static const Keys* k = new Keys();  // needs the GIL: every caller holds it
  return *k;
}

bool type_in(PyObject* obj, PyObject* types) {
  const Py_ssize_t n = PyTuple_GET_SIZE(types);
  for (Py_ssize_t i = 0; i < n; ++i)
    if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) == PyTuple_GET_ITEM(types, i)) return true;
  return false;
}

// A plain strided CPU tensor: the kind whose bytes can be reasoned about by address.
bool plain_cpu(const at::Tensor& t) {
  return t.layout() == c10::kStrided && t.device().is_cpu();
}

bool as_u64(PyObject* v, uint64_t* out) {
  if (v == nullptr || !PyLong_CheckExact(v)) return false;
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow != 0 || x < 0) return false;
  *out = static_cast<uint64_t>(x);
  return true;
}

// The list of non-negative ints `v` equals `want`.
bool same_ints(PyObject* v, c10::IntArrayRef want) {
  if (v == nullptr || !PyList_CheckExact(v) ||
      PyList_GET_SIZE(v) != static_cast<Py_ssize_t>(want.size()))
    return false;
  for (size_t i = 0; i < want.size(); ++i) {
    uint64_t x = 0;
    if (!as_u64(PyList_GET_ITEM(v, static_cast<Py_ssize_t>(i)), &x) ||
        static_cast<int64_t>(x) != want[i])
      return false;
  }
  return true;
}

// torch's contiguity rule (c10 compute_contiguous) for a view of `sizes` (checked
// ints) and `strides` (a list of as many): size-1 dimensions' strides do not count.
bool contiguous_view(c10::IntArrayRef sizes, PyObject* strides) {
  if (strides == nullptr || !PyList_CheckExact(strides) ||
      PyList_GET_SIZE(strides) != static_cast<Py_ssize_t>(sizes.size()))
    return false;
  std::vector<uint64_t> st(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i)
    if (!as_u64(PyList_GET_ITEM(strides, static_cast<Py_ssize_t>(i)), &st[i])) return false;
  for (const int64_t n : sizes)
    if (n == 0) return true;  // no elements
  uint64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    const uint64_t n = static_cast<uint64_t>(sizes[i]);
    if (n == 1) continue;
    if (st[i] != expected) return false;
    expected *= n;
  }
  return true;
}

bool usable_dst(PyObject* obj, PyObject* plain_types, const at::Tensor** out) {
  if (!type_in(obj, plain_types) || !THPVariable_Check(obj)) return false;
  const at::Tensor& d = THPVariable_Unpack(obj);
  if (!plain_cpu(d) || !d.is_contiguous() || d.is_inference() || d.is_conj() || d.is_neg())
    return false;
  *out = &d;
  return true;
}

// (offset in the buffer, bytes) of entry `e` copied into `d`, or false.
bool entry_span(const at::Tensor& d, PyObject* e, PyObject* dtypes, uint64_t size,
                uint64_t* off, uint64_t* n) {
  const Keys& k = keys();
  PyObject* name = PyDict_GetItem(e, k.dtype);
  PyObject* dt = name != nullptr && PyUnicode_CheckExact(name) ? PyDict_GetItem(dtypes, name)
                                                               : nullptr;
  if (dt == nullptr || !THPDtype_Check(dt) ||
      reinterpret_cast<THPDtype*>(dt)->scalar_type != d.scalar_type())
    return false;
  // Same shape as d, and a contiguous view: the bytes are d's, in d's order.
  if (!same_ints(PyDict_GetItem(e, k.shape), d.sizes()) ||
      !contiguous_view(d.sizes(), PyDict_GetItem(e, k.stride)))
    return false;
  uint64_t nbytes = 0;
  if (!as_u64(PyDict_GetItem(e, k.offset), off) || !as_u64(PyDict_GetItem(e, k.nbytes), &nbytes))
    return false;
  *n = d.nbytes();
  // The entry's view: data[off:off + nbytes] viewed as dtype, of the entry's shape.
  return *n > 0 && nbytes >= *n && *off <= size && nbytes <= size - *off;
}

bool tensor_span(const at::Tensor& d, PyObject* s, PyObject* src_type, uint64_t lo,
                 uint64_t size, uint64_t* off, uint64_t* n) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(s)) != src_type || !THPVariable_Check(s)) return false;
  const at::Tensor& t = THPVariable_Unpack(s);
  if (!plain_cpu(t) || t.scalar_type() != d.scalar_type() || t.sizes() != d.sizes() ||
      !t.is_contiguous() || t.is_conj() || t.is_neg())
    return false;
  *n = d.nbytes();
  const uint64_t p = reinterpret_cast<uint64_t>(t.data_ptr());
  if (*n == 0 || p < lo || p - lo > size || *n > size - (p - lo)) return false;
  *off = p - lo;
  return true;
}

uint64_t span_bytes(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  uint64_t last = 0;
  for (size_t i = 0; i < t.sizes().size(); ++i)
    last += static_cast<uint64_t>(t.sizes()[i] - 1) * static_cast<uint64_t>(t.strides()[i]);
  return static_cast<uint64_t>(t.element_size()) * (last + 1);
}

struct Extent {
  uint64_t lo, hi;
  int64_t pair;
};

}  // namespace

RestorePlan plan_restore(PyObject* dsts, PyObject* srcs, PyObject* dtypes, PyObject* plain_types,
                         PyObject* src_type, uint64_t lo, uint64_t size) {
  CUDASNAP_CHECK(PyList_Check(dsts) && PyList_Check(srcs) &&
                     PyList_GET_SIZE(dsts) == PyList_GET_SIZE(srcs),
                 "plan_restore: dsts and srcs must be lists of the same length");
  CUDASNAP_CHECK(PyDict_Check(dtypes) && PyTuple_Check(plain_types),
                 "plan_restore: dtypes must be a dict, plain_types a tuple");
  const Py_ssize_t count = PyList_GET_SIZE(dsts);
  std::vector<int64_t> span_of(static_cast<size_t>(count), -1);  // pair -> its span
  std::vector<Extent> ext;
  ext.reserve(static_cast<size_t>(count));
  RestorePlan plan;
  plan.spans.reserve(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* dobj = PyList_GET_ITEM(dsts, i);
    PyObject* s = PyList_GET_ITEM(srcs, i);
    const at::Tensor* d = nullptr;
    uint64_t off = 0, n = 0;
    if (lo != 0 && usable_dst(dobj, plain_types, &d) &&
        (PyDict_CheckExact(s) ? entry_span(*d, s, dtypes, size, &off, &n)
                              : tensor_span(*d, s, src_type, lo, size, &off, &n))) {
      const uint64_t p = reinterpret_cast<uint64_t>(d->data_ptr());
      span_of[static_cast<size_t>(i)] = static_cast<int64_t>(plan.spans.size());
      plan.spans.push_back({p, off, n});
      plan.dsts.push_back(dobj);
      ext.push_back({p, p + n, i});
      continue;
    }
    // Not a byte copy: its destination still counts for overlaps when it has an address.
    if (type_in(dobj, plain_types) && THPVariable_Check(dobj)) {
      const at::Tensor& t = THPVariable_Unpack(dobj);
      if (plain_cpu(t)) {
        const uint64_t nb = span_bytes(t);
        const uint64_t p = reinterpret_cast<uint64_t>(t.data_ptr());
        if (nb != 0) ext.push_back({p, p + nb, i});
      }
    }
  }
  // Groups of overlapping destinations (copy_back._overlapping): all go to torch.
  std::sort(ext.begin(), ext.end(), [](const Extent& a, const Extent& b) {
    return a.lo != b.lo ? a.lo < b.lo : a.pair < b.pair;
  });
  std::vector<char> overlapped(static_cast<size_t>(count), 0);
  size_t start = 0;
  uint64_t end = 0;
  for (size_t k = 0; k <= ext.size(); ++k) {
    if (k == ext.size() || (k > start && ext[k].lo >= end)) {
      if (k - start > 1)
        for (size_t j = start; j < k; ++j) overlapped[static_cast<size_t>(ext[j].pair)] = 1;
      start = k;
      if (k == ext.size()) break;
    }
    end = k == start ? ext[k].hi : std::max(end, ext[k].hi);
  }
  RestorePlan out;
  out.spans.reserve(plan.spans.size());
  for (Py_ssize_t i = 0; i < count; ++i) {
    const int64_t sp = span_of[static_cast<size_t>(i)];
    if (sp >= 0 && !overlapped[static_cast<size_t>(i)]) {
      out.spans.push_back(plan.spans[static_cast<size_t>(sp)]);
      out.dsts.push_back(plan.dsts[static_cast<size_t>(sp)]);
    } else {
      out.slow.push_back(i);
    }
  }
  return out;
}

void bump_versions(const RestorePlan& plan) {
  for (PyObject* obj : plan.dsts) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
  }
}

}  // namespace cudasnap
