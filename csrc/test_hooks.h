// TEST-ONLY fault hooks. Compiled into every build, inert until a test arms
// them through an explicit call (_C._arm_test_hook, from cudasnap/_testing);
// never armed from the environment by this code.
//
// Kill points: kill_point(phase) is placed in the engine where a crash must
// leave the previous snapshot loadable. Armed with (phase, n), the process
// SIGKILLs itself the n-th time it reaches `phase`. Disarmed, kill_point is
// one relaxed atomic load.
//   "copy"   slot data copied, header not written   (staging.cpp, commit)
//   "header" header half written                     (staging.cpp, commit)
//   "write"  first data piece written to the file    (flusher.cpp)
//   "fsync"  data written, not yet synced            (flusher.cpp)
#pragma once

#include <string>
#include <vector>

namespace cudasnap::test_hooks {

// The phases kill_point() is called with.
const std::vector<std::string>& kill_phases();
// Arms the kill point (hit counts restart); throws on an unknown phase or n < 1.
void arm_kill(const std::string& phase, long nth);
// Disarms every hook.
void disarm() noexcept;
// The armed kill phase, or "" when disarmed.
std::string armed_kill();

void kill_point(const char* phase) noexcept;

}  // namespace cudasnap::test_hooks
