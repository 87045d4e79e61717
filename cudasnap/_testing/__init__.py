"""Test-only fault hooks: inert unless a test arms them (``faults.arm_kill``,
``arena_gate.gate``) or starts the process with their environment variables set (read
once, at import)."""
