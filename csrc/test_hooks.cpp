#include "test_hooks.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include "error.h"

namespace cudasnap::test_hooks {

namespace {

std::atomic<bool> g_armed{false};
std::mutex g_mu;
std::string g_phase;  // under g_mu
long g_nth = 1;
long g_hits = 0;

}  // namespace

const std::vector<std::string>& kill_phases() {
  static const std::vector<std::string> phases{"copy", "header", "write", "fsync"};
  return phases;
}

void arm_kill(const std::string& phase, long nth) {
  const auto& ph = kill_phases();
  CUDASNAP_CHECK(std::find(ph.begin(), ph.end(), phase) != ph.end(),
                 "unknown native kill phase '" << phase << "' (copy, header, write, fsync)");
  CUDASNAP_CHECK(nth >= 1, "kill phase '" << phase << "': n must be >= 1, got " << nth);
  std::lock_guard<std::mutex> g(g_mu);
  g_phase = phase;
  g_nth = nth;
  g_hits = 0;
  g_armed.store(true, std::memory_order_release);
}

void disarm() noexcept {
  std::lock_guard<std::mutex> g(g_mu);
  g_armed.store(false, std::memory_order_release);
  g_phase.clear();
  g_hits = 0;
}

std::string armed_kill() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_phase;
}

void kill_point(const char* phase) noexcept {
  if (!g_armed.load(std::memory_order_relaxed)) return;
  bool die = false;
  {
    std::lock_guard<std::mutex> g(g_mu);
    die = g_armed.load(std::memory_order_acquire) && g_phase == phase && ++g_hits >= g_nth;
  }
  if (die) ::kill(::getpid(), SIGKILL);
}

}  // namespace cudasnap::test_hooks
