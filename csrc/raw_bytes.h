// put_raw: a value's bytes, as they lie in memory, appended to a string. The state and
// host watches (state_watch.cpp, python/host_watch.cpp) build their byte images with it
// and compare them exactly.
#pragma once

#include <string>
#include <type_traits>

namespace cudasnap {

template <typename T>
inline void put_raw(std::string& out, const T& v) {
  static_assert(std::is_trivially_copyable_v<T>, "put_raw: a plain value only");
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

}  // namespace cudasnap
