#include "signals.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <mutex>

#include "error.h"

namespace cudasnap {
namespace {

constexpr int kMaxSig = 65;
std::atomic<int> g_write_fd{-1};
int g_read_fd = -1;
struct sigaction g_prev[kMaxSig];
bool g_installed[kMaxSig] = {};
std::mutex g_mu;

void on_signal(int signum, siginfo_t* info, void* ctx) {
  int saved = errno;
  int fd = g_write_fd.load(std::memory_order_relaxed);
  if (fd >= 0) {
    unsigned char b = static_cast<unsigned char>(signum);
    ssize_t r = ::write(fd, &b, 1);  // non-blocking; a full pipe drops a duplicate
    (void)r;
  }
  // Chain the previous handler unless it was the default (we take over the
  // default action: the monitor thread exits after the flush) or ignore.
  if (signum > 0 && signum < kMaxSig && g_installed[signum]) {
    const struct sigaction& p = g_prev[signum];
    if (p.sa_flags & SA_SIGINFO) {
      if (p.sa_sigaction) p.sa_sigaction(signum, info, ctx);
    } else if (p.sa_handler != SIG_DFL && p.sa_handler != SIG_IGN && p.sa_handler) {
      p.sa_handler(signum);
    }
  }
  errno = saved;
}

}  // namespace

int install_signal_pipe(const std::vector<int>& signals) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_read_fd < 0) {
    int fds[2];
    CUDASNAP_SYSCHECK(::pipe2(fds, O_CLOEXEC), ErrorKind::Generic, "signal pipe");
    int fl = ::fcntl(fds[1], F_GETFL);
    CUDASNAP_SYSCHECK(::fcntl(fds[1], F_SETFL, fl | O_NONBLOCK), ErrorKind::Generic,
                      "signal pipe non-blocking");
    g_read_fd = fds[0];
    g_write_fd.store(fds[1]);
  }
  for (int s : signals) {
    CUDASNAP_CHECK(s > 0 && s < kMaxSig, "bad signal number " << s);
    if (g_installed[s]) continue;
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    CUDASNAP_SYSCHECK(::sigaction(s, &sa, &g_prev[s]), ErrorKind::Generic,
                      "sigaction for signal " << s);
    g_installed[s] = true;
  }
  return g_read_fd;
}

void uninstall_signal_pipe() {
  std::lock_guard<std::mutex> g(g_mu);
  for (int s = 1; s < kMaxSig; ++s) {
    if (!g_installed[s]) continue;
    ::sigaction(s, &g_prev[s], nullptr);
    g_installed[s] = false;
  }
  int w = g_write_fd.exchange(-1);
  if (w >= 0) ::close(w);  // wakes the reader with EOF
  if (g_read_fd >= 0) {
    // The reader thread owns closing the read end after EOF; forget it here.
    g_read_fd = -1;
  }
}

}  // namespace cudasnap
