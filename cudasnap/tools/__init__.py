"""Command-line tools around the library: the cudasnap command, the supervisor, transparent
mode, export, Prometheus metrics, progress bars, the checkpoint-interval analysis."""
