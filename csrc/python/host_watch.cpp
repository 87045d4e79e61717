#include "host_watch.h"

#include <cstring>
#include <stdexcept>

#include "../error.h"
#include "../raw_bytes.h"

namespace cudasnap {

void put_plain_value(std::string& cur_, PyObject* v, int depth) {
  if (depth > 64) throw std::invalid_argument("ValueWatch: nested deeper than 64");
  if (v == Py_None) {
    cur_.push_back('N');
  } else if (v == Py_True || v == Py_False) {
    cur_.push_back(v == Py_True ? 'T' : 'F');
  } else if (PyLong_CheckExact(v)) {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) throw std::invalid_argument("ValueWatch: int beyond 64 bits");
    cur_.push_back('i');
    put_raw(cur_, x);
  } else if (PyFloat_CheckExact(v)) {
    cur_.push_back('f');
    put_raw(cur_, PyFloat_AS_DOUBLE(v));  // the bits: -0.0 and each NaN differ
  } else if (PyUnicode_CheckExact(v)) {
    Py_ssize_t n = 0;
    const char* u = PyUnicode_AsUTF8AndSize(v, &n);
    if (u == nullptr) {
      PyErr_Clear();
      throw std::invalid_argument("ValueWatch: a str without UTF-8 form");
    }
    cur_.push_back('s');
    put_raw(cur_, static_cast<int64_t>(n));
    cur_.append(u, static_cast<size_t>(n));
  } else if (PyBytes_CheckExact(v)) {
    cur_.push_back('b');
    put_raw(cur_, static_cast<int64_t>(PyBytes_GET_SIZE(v)));
    cur_.append(PyBytes_AS_STRING(v), static_cast<size_t>(PyBytes_GET_SIZE(v)));
  } else if (PyTuple_CheckExact(v) || PyList_CheckExact(v)) {
    const bool tuple = PyTuple_CheckExact(v);
    const Py_ssize_t n = tuple ? PyTuple_GET_SIZE(v) : PyList_GET_SIZE(v);
    cur_.push_back(tuple ? 't' : 'l');
    put_raw(cur_, static_cast<int64_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i)
      put_plain_value(cur_, tuple ? PyTuple_GET_ITEM(v, i) : PyList_GET_ITEM(v, i), depth + 1);
  } else if (PyDict_CheckExact(v)) {
    cur_.push_back('d');
    put_raw(cur_, static_cast<int64_t>(PyDict_GET_SIZE(v)));
    Py_ssize_t pos = 0;
    PyObject *k, *x;
    while (PyDict_Next(v, &pos, &k, &x)) {  // borrowed; nothing here runs Python code
      put_plain_value(cur_, k, depth + 1);
      put_plain_value(cur_, x, depth + 1);
    }
  } else {
    throw std::invalid_argument(std::string("ValueWatch: a ") + Py_TYPE(v)->tp_name +
                                " is not a plain value");
  }
}

bool ValueWatch::changed(PyObject* value) {
  cur_.clear();
  try {
    put_plain_value(cur_, value, 0);
  } catch (...) {
    first_ = true;  // the next plain value counts as changed
    throw;
  }
  bool diff = first_ || cur_ != last_;
  first_ = false;
  if (diff) last_.swap(cur_);
  return diff;
}

// ---------------------------------------------------------------- HostWatch

namespace {
PyObject* owned(PyObject* o) {
  Py_XINCREF(o);
  return o;
}
}  // namespace

HostWatch::~HostWatch() {
  for (Source& s : src_) {
    for (Same& x : s.same) {
      Py_XDECREF(x.obj);
      Py_XDECREF(x.expected);
      for (PyObject* n : x.names) Py_XDECREF(n);
    }
    Py_XDECREF(s.gauss);
    Py_XDECREF(s.flag_obj);
    Py_XDECREF(s.flag_attr);
  }
  Py_XDECREF(optim_);
  Py_XDECREF(scalar_keys_);
  Py_XDECREF(params_key_);
  Py_XDECREF(groups_attr_);
  Py_XDECREF(gauss_attr_);
}

int HostWatch::add_watched(std::vector<std::pair<uint64_t, uint64_t>> regions, bool torch_cpu_rng,
                           PyObject* same, PyObject* gauss) {
  CUDASNAP_CHECK(src_.size() < 40, "HostWatch: at most 40 sources");
  CUDASNAP_CHECK(PyList_Check(same), "HostWatch.add_watched: `same` must be a list");
  Source s;
  s.kind = Source::kWatched;
  s.watch = std::make_unique<StateWatch>(std::move(regions), torch_cpu_rng);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(same); ++i) {
    PyObject* e = PyList_GET_ITEM(same, i);
    CUDASNAP_CHECK(PyTuple_Check(e) && PyTuple_GET_SIZE(e) == 3 &&
                       PyTuple_Check(PyTuple_GET_ITEM(e, 1)),
                   "HostWatch.add_watched: item " << i
                                                  << " is not an (object, (names...), expected) tuple");
    PyObject* names = PyTuple_GET_ITEM(e, 1);
    Same x;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(names); ++k) {
      CUDASNAP_CHECK(PyUnicode_Check(PyTuple_GET_ITEM(names, k)),
                     "HostWatch.add_watched: attribute names must be str");
    }
    x.obj = owned(PyTuple_GET_ITEM(e, 0));
    x.expected = owned(PyTuple_GET_ITEM(e, 2));
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(names); ++k)
      x.names.push_back(owned(PyTuple_GET_ITEM(names, k)));
    s.same.push_back(std::move(x));
  }
  if (gauss != nullptr && gauss != Py_None) {
    if (gauss_attr_ == nullptr) gauss_attr_ = PyUnicode_InternFromString("gauss_next");
    CUDASNAP_CHECK(gauss_attr_ != nullptr, "HostWatch: cannot make an attribute name");
    s.gauss = owned(gauss);
  }
  src_.push_back(std::move(s));
  return static_cast<int>(src_.size()) - 1;
}

int HostWatch::add_always() {
  CUDASNAP_CHECK(src_.size() < 40, "HostWatch: at most 40 sources");
  src_.emplace_back();
  return static_cast<int>(src_.size()) - 1;
}

int HostWatch::add_flag(PyObject* module, PyObject* attr) {
  CUDASNAP_CHECK(src_.size() < 40, "HostWatch: at most 40 sources");
  CUDASNAP_CHECK(PyUnicode_Check(attr), "HostWatch.add_flag: the attribute name must be a str");
  Source s;
  s.kind = Source::kFlag;
  s.flag_obj = owned(module);
  s.flag_attr = owned(attr);
  src_.push_back(std::move(s));
  return static_cast<int>(src_.size()) - 1;
}

void HostWatch::unwatch(int index) {
  CUDASNAP_CHECK(index >= 0 && index < size(), "HostWatch: no source " << index);
  src_[static_cast<size_t>(index)].kind = Source::kAlways;
}

void HostWatch::set_optim(PyObject* optimizers, PyObject* scalar_keys) {
  CUDASNAP_CHECK(PyDict_Check(optimizers) && PyDict_Check(scalar_keys),
                 "HostWatch.set_optim expects two dicts");
  if (params_key_ == nullptr) params_key_ = PyUnicode_InternFromString("params");
  if (groups_attr_ == nullptr) groups_attr_ = PyUnicode_InternFromString("param_groups");
  CUDASNAP_CHECK(params_key_ && groups_attr_, "HostWatch: cannot make an attribute name");
  Py_XDECREF(optim_);
  Py_XDECREF(scalar_keys_);
  optim_ = owned(optimizers);
  scalar_keys_ = owned(scalar_keys);
  optim_first_ = true;
}

bool HostWatch::still_same(const Source& s) const {
  for (const Same& x : s.same) {
    PyObject* cur = owned(x.obj);
    for (PyObject* name : x.names) {
      PyObject* next = PyObject_GetAttr(cur, name);  // new reference (may run Python code)
      Py_DECREF(cur);
      if (next == nullptr) {
        PyErr_Clear();
        return false;
      }
      cur = next;
    }
    const bool ok = cur == x.expected;
    Py_DECREF(cur);
    if (!ok) return false;
  }
  return true;
}

bool HostWatch::gauss_changed(Source& s) {
  if (s.gauss == nullptr) return false;
  s.gauss_cur.clear();
  PyObject* g = PyObject_GetAttr(s.gauss, gauss_attr_);
  bool exact = true;
  if (g == nullptr) {
    PyErr_Clear();
    s.gauss_cur.push_back('E');
  } else if (g == Py_None) {
    s.gauss_cur.push_back('N');
  } else if (PyFloat_CheckExact(g)) {
    s.gauss_cur.push_back('f');
    put_raw(s.gauss_cur, PyFloat_AS_DOUBLE(g));
  } else {
    exact = false;  // another type: compared by the Python path (always "changed" here)
  }
  Py_XDECREF(g);
  const bool diff = !exact || s.gauss_first || s.gauss_cur != s.gauss_last;
  s.gauss_first = !exact;
  if (diff) s.gauss_last.swap(s.gauss_cur);
  return diff;
}

bool HostWatch::put_optim(std::string& out) {
  // Per-parameter scalars are read from opt.state by the Python path: not watched here.
  Py_ssize_t pos = 0;
  PyObject *k, *v;
  while (PyDict_Next(scalar_keys_, &pos, &k, &v))
    if (!PyList_CheckExact(v) || PyList_GET_SIZE(v) != 0) return false;
  put_raw(out, static_cast<int64_t>(PyDict_GET_SIZE(optim_)));
  pos = 0;
  PyObject* opt;
  while (PyDict_Next(optim_, &pos, &k, &opt)) {
    put_plain_value(out, k);
    put_raw(out, reinterpret_cast<uintptr_t>(Py_TYPE(opt)));  // the class name comes from it
    PyObject* groups = PyObject_GetAttr(opt, groups_attr_);  // new reference
    if (groups == nullptr) {
      PyErr_Clear();
      return false;
    }
    bool ok = PyList_CheckExact(groups);
    if (ok) {
      put_raw(out, static_cast<int64_t>(PyList_GET_SIZE(groups)));
      for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(groups); ++i) {
        PyObject* g = PyList_GET_ITEM(groups, i);
        if (!PyDict_CheckExact(g)) {
          ok = false;
          break;
        }
        put_raw(out, static_cast<int64_t>(PyDict_GET_SIZE(g)));
        Py_ssize_t gp = 0;
        PyObject *gk, *gv;
        while (ok && PyDict_Next(g, &gp, &gk, &gv)) {
          put_plain_value(out, gk);
          if (gk == params_key_ || (PyUnicode_CheckExact(gk) &&
                                    PyUnicode_Compare(gk, params_key_) == 0)) {
            // Only the count is saved (first index, count): not the tensors.
            Py_ssize_t n = PyList_CheckExact(gv) ? PyList_GET_SIZE(gv) : -1;
            if (n < 0) ok = false;
            out.push_back('P');
            put_raw(out, static_cast<int64_t>(n));
          } else {
            put_plain_value(out, gv);  // throws for a value that is not plain
          }
        }
      }
    }
    Py_DECREF(groups);
    if (!ok) return false;
  }
  return true;
}

bool HostWatch::optim_changed() {
  optim_cur_.clear();
  bool plain = false;
  try {
    plain = put_optim(optim_cur_);
  } catch (const std::invalid_argument&) {
    plain = false;  // a tensor learning rate, an object: encoded by the Python path
  }
  if (!plain) {
    optim_first_ = true;
    return true;
  }
  const bool diff = optim_first_ || optim_cur_ != optim_last_;
  optim_first_ = false;
  if (diff) optim_last_.swap(optim_cur_);
  return diff;
}

uint64_t HostWatch::changed() {
  uint64_t mask = 0;
  for (size_t i = 0; i < src_.size(); ++i) {
    Source& s = src_[i];
    bool diff = true;
    if (s.kind == Source::kWatched) {
      // Both compared at every call (each remembers what it saw).
      diff = !still_same(s);
      if (!diff) {
        const bool bytes = s.watch->changed();
        diff = gauss_changed(s) || bytes;
      }
    } else if (s.kind == Source::kFlag) {
      PyObject* v = PyObject_GetAttr(s.flag_obj, s.flag_attr);
      int on = v == nullptr ? 1 : PyObject_IsTrue(v);
      if (v == nullptr || on < 0) {
        PyErr_Clear();
        on = 1;
      }
      Py_XDECREF(v);
      diff = on || s.flag_was;
      s.flag_was = on != 0;
    }
    if (diff) mask |= uint64_t(1) << i;
  }
  if (optim_ != nullptr && optim_changed()) mask |= kOptimBit;
  return mask;
}

}  // namespace cudasnap
