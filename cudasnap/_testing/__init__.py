"""Test-only fault hooks: inert unless a test arms them (``faults.arm_kill``) or starts
the process with their environment variables set (read once, at import)."""
