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

#include <cstdint>
#include <memory>
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
  bool same_as_last();
  static void append_torch(std::string& out);
  std::vector<std::pair<uint64_t, uint64_t>> regions_;
  bool torch_;
  bool first_ = true;
  std::string last_, cur_;
};

}  // namespace cudasnap
