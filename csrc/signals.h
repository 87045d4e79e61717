// Signal self-pipe: deliver SIGTERM/SIGUSR1 to a monitor thread.
//
// A Python-level signal handler only runs when the main thread executes
// bytecode; a main thread blocked in a collective (NCCL/gloo) or a CUDA call
// would never flush. Here an async-signal-safe C handler writes the signal
// number into a pipe that a dedicated thread reads, whatever the main thread
// is doing. The previous handler (e.g. Python's own) is chained.
#pragma once

#include <vector>

namespace cudasnap {

// Installs the handler for `signals`; returns the pipe's read end (blocking).
// Calling it again adds signals to the same pipe.
int install_signal_pipe(const std::vector<int>& signals);
// Restores the previous handlers and closes the pipe.
void uninstall_signal_pipe();

}  // namespace cudasnap
