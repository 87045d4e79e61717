#include "state_watch.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/MT19937RNGEngine.h>

#include <cstring>
#include <mutex>

#include "error.h"
#include "raw_bytes.h"

namespace cudasnap {

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
  if (torch_) append_torch(out);
}

void StateWatch::append_torch(std::string& out) {
  {
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

bool StateWatch::same_as_last() {
  // Compares the watched bytes where they are with the last call's copy: no copy of
  // them while nothing changed (half the memory touched by a boundary's check).
  size_t off = 0;
  for (const auto& r : regions_) {
    if (off + r.second > last_.size() ||
        std::memcmp(last_.data() + off, reinterpret_cast<const void*>(r.first), r.second) != 0)
      return false;
    off += r.second;
  }
  if (torch_) {
    cur_.clear();  // the generator's fields, as read() appends them (reserved: no malloc)
    append_torch(cur_);
    if (off + cur_.size() != last_.size() ||
        std::memcmp(last_.data() + off, cur_.data(), cur_.size()) != 0)
      return false;
    off += cur_.size();
  }
  return off == last_.size();
}

bool StateWatch::changed() {
  if (!first_ && same_as_last()) return false;
  first_ = false;
  read(last_);
  return true;
}

}  // namespace cudasnap
