// State watch: has a piece of host state changed since the last look?
//
// The boundary re-encodes an RNG state only when it changed. Reading the
// state through its Python API costs 20-150 us per source (numpy's
// get_state() copies its 624 key words one by one); comparing the raw bytes
// behind it costs well under a microsecond and never allocates.
//
// A watch covers memory regions (the caller keeps them alive: the Python
// objects they belong to are held by cudasnap.core.host_capture) and, when
// asked, the default torch CPU generator. The comparison is exact: any byte
// that differs, padding included, counts as a change (a false "changed" only
// costs a re-encode; a missed change is impossible for the watched bytes).
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace cudasnap {

class StateWatch {
 public:
  // regions: (address, bytes). torch_cpu_rng: also watch the default CPU generator
  // (its Mersenne-Twister state and both cached normal samples).
  StateWatch(std::vector<std::pair<uint64_t, uint64_t>> regions, bool torch_cpu_rng);
  // True on the first call and whenever a watched byte differs from the last call's;
  // remembers the current bytes either way.
  bool changed();
  size_t watched_bytes() const { return last_.size(); }

 private:
  void read(std::string& out) const;
  std::vector<std::pair<uint64_t, uint64_t>> regions_;
  bool torch_;
  bool first_ = true;
  std::string last_, cur_;
};

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
  void put(PyObject* v, int depth);
  bool first_ = true;
  std::string last_, cur_;
};

}  // namespace cudasnap
