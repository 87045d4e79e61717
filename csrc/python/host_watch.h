// Host watch: the Python-facing side of the state watch (csrc/state_watch.h).
//
// Walks Python objects (plain values, generator identities, attributes and the
// optimizers' param groups) with the GIL held; the byte comparison of the RNG
// states themselves is StateWatch's, in the engine.
#pragma once

#include <Python.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../state_watch.h"

namespace cudasnap {

// Has a plain Python value (None, bool, int, float, str, bytes and tuples, lists
// and dicts of them) changed since the last call? Compares an exact serialization
// (type tags, float bits, dict order) in a reused buffer: no Python object and,
// once the buffer is large enough, no allocation at all (a >= 1 KB malloc right
// after an optimizer step pays glibc's consolidation of the small blocks it freed).
class ValueWatch {
 public:
  // True on the first call and whenever the value differs from the last call's.
  // Throws std::invalid_argument (ValueError) for any other type (the caller
  // then encodes the value every time).
  bool changed(PyObject* value);

 private:
  bool first_ = true;
  std::string last_, cur_;
};

// Appends ValueWatch's exact serialization of a plain value to `out`; throws
// std::invalid_argument for anything else.
void put_plain_value(std::string& out, PyObject* v, int depth = 0);

// Every watched piece of a boundary's host state in ONE call (no Python code
// on the unchanged path, no Python object made): the RNG sources' bytes (as
// StateWatch), the identity of the generator objects they belong to, a cached
// normal sample kept as a Python attribute, a flag attribute (torch.cuda's
// "_initialized") and the optimizers' param groups. `changed()` returns a bit
// mask of what must be read again: bit i for source i, kOptimBit for the
// param groups. Held objects are owned references (released with the GIL held,
// as pybind destroys the watch).
class HostWatch {
 public:
  static constexpr uint64_t kOptimBit = uint64_t(1) << 40;
  HostWatch() = default;
  ~HostWatch();
  HostWatch(const HostWatch&) = delete;
  HostWatch& operator=(const HostWatch&) = delete;
  // A source compared byte by byte (regions / torch CPU generator as StateWatch).
  // `same`: a list of (object, tuple of attribute names, expected object): the
  // source counts as changed while getattr(object, names...) is not `expected`.
  // `gauss`: an object whose `gauss_next` attribute is compared too, or None.
  int add_watched(std::vector<std::pair<uint64_t, uint64_t>> regions, bool torch_cpu_rng,
                  PyObject* same, PyObject* gauss);
  int add_always();  // read at every boundary
  // Changed while getattr(module, attr) is true, and once when it turns false.
  int add_flag(PyObject* module, PyObject* attr);
  void unwatch(int index);  // from now on read at every boundary
  // `optimizers`: a dict name -> optimizer; `scalar_keys`: a dict whose values are
  // lists (non-empty: per-parameter scalars the Python path reads: always changed).
  void set_optim(PyObject* optimizers, PyObject* scalar_keys);
  uint64_t changed();
  int size() const { return static_cast<int>(src_.size()); }

 private:
  struct Same {
    PyObject* obj = nullptr;
    std::vector<PyObject*> names;
    PyObject* expected = nullptr;
  };
  struct Source {
    enum Kind { kWatched, kAlways, kFlag } kind = kAlways;
    std::unique_ptr<StateWatch> watch;
    std::vector<Same> same;
    PyObject* gauss = nullptr;
    std::string gauss_last, gauss_cur;
    bool gauss_first = true;
    PyObject* flag_obj = nullptr;
    PyObject* flag_attr = nullptr;
    bool flag_was = false;
  };
  bool still_same(const Source& s) const;
  bool gauss_changed(Source& s);
  bool optim_changed();
  bool put_optim(std::string& out);
  std::vector<Source> src_;
  PyObject* optim_ = nullptr;
  PyObject* scalar_keys_ = nullptr;
  PyObject* params_key_ = nullptr;
  PyObject* groups_attr_ = nullptr;
  PyObject* gauss_attr_ = nullptr;
  bool optim_first_ = true;
  std::string optim_last_, optim_cur_;
};

}  // namespace cudasnap
