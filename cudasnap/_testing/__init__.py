"""Test-only fault hooks: inert unless the fault tests set their environment variables."""
