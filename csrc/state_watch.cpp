#include "state_watch.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/MT19937RNGEngine.h>

#include <cstring>
#include <mutex>
#include <stdexcept>

#include "error.h"

namespace cudasnap {

namespace {
template <typename T>
void put_raw(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}
}  // namespace

StateWatch::StateWatch(std::vector<std::pair<uint64_t, uint64_t>> regions, bool torch_cpu_rng)
    : regions_(std::move(regions)), torch_(torch_cpu_rng) {
  uint64_t total = 0;
  for (const auto& r : regions_) {
    CUDASNAP_CHECK(r.first != 0 || r.second == 0, "StateWatch: a region at address 0");
    CUDASNAP_CHECK(r.second <= (1u << 20), "StateWatch: region of " << r.second
                                                << " bytes; at most 1 MiB per region");
    total += r.second;
  }
  last_.reserve(total + 4096);
  cur_.reserve(total + 4096);
}

void StateWatch::read(std::string& out) const {
  out.clear();
  for (const auto& r : regions_) out.append(reinterpret_cast<const char*>(r.first), r.second);
  if (torch_) {
    // Everything CPUGeneratorImpl::get_state() serializes, field by field (no padding).
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
    const at::mt19937 eng = impl->engine();
    const at::mt19937_data_pod d = eng.data();
    put_raw(out, d.seed_);
    put_raw(out, d.left_);
    put_raw(out, static_cast<uint8_t>(d.seeded_));
    put_raw(out, d.next_);
    out.append(reinterpret_cast<const char*>(d.state_.data()), d.state_.size() * sizeof(uint32_t));
    const std::optional<float> f = impl->next_float_normal_sample();
    const std::optional<double> g = impl->next_double_normal_sample();
    put_raw(out, static_cast<uint8_t>(f.has_value()));
    put_raw(out, f.value_or(0.0f));
    put_raw(out, static_cast<uint8_t>(g.has_value()));
    put_raw(out, g.value_or(0.0));
  }
}

bool StateWatch::changed() {
  read(cur_);
  bool diff = first_ || cur_.size() != last_.size() ||
              std::memcmp(cur_.data(), last_.data(), cur_.size()) != 0;
  first_ = false;
  if (diff) last_.swap(cur_);
  return diff;
}

void ValueWatch::put(PyObject* v, int depth) {
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
      put(tuple ? PyTuple_GET_ITEM(v, i) : PyList_GET_ITEM(v, i), depth + 1);
  } else if (PyDict_CheckExact(v)) {
    cur_.push_back('d');
    put_raw(cur_, static_cast<int64_t>(PyDict_GET_SIZE(v)));
    Py_ssize_t pos = 0;
    PyObject *k, *x;
    while (PyDict_Next(v, &pos, &k, &x)) {  // borrowed; nothing here runs Python code
      put(k, depth + 1);
      put(x, depth + 1);
    }
  } else {
    throw std::invalid_argument(std::string("ValueWatch: a ") + Py_TYPE(v)->tp_name +
                                " is not a plain value");
  }
}

bool ValueWatch::changed(PyObject* value) {
  cur_.clear();
  try {
    put(value, 0);
  } catch (...) {
    first_ = true;  // the next plain value counts as changed
    throw;
  }
  bool diff = first_ || cur_ != last_;
  first_ = false;
  if (diff) last_.swap(cur_);
  return diff;
}

}  // namespace cudasnap
