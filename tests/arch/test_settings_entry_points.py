"""``Settings.from_env()`` is called at entry points only (issue 47 item 4).

An entry point (the Snapshotter's constructor, ``cudasnap run``, the CLI, an integration,
the transparent mode, the demo, the in-process restart's wrapper) reads the environment
once when it starts and hands the values, or the Settings, down; a component below it
(storage, triggers, the coordinator) receives them and never reads the environment
itself. The scan counts every ``Settings.from_env(...)`` call of the package.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "cudasnap"

ENTRY_POINTS = {
    "cudasnap/snapshotter.py",                 # Snapshotter.__init__
    "cudasnap/supervisor/run.py",              # cudasnap run: its arguments
    "cudasnap/supervisor/loop.py",             # cudasnap run: the supervisor
    "cudasnap/supervisor/child.py",            # cudasnap run: an attempt's policy
    "cudasnap/supervisor/inprocess_launch.py",  # cudasnap run --inprocess
    "cudasnap/tools/cli.py",                   # the cudasnap command
    "cudasnap/tools/auto.py",                  # transparent mode's install()
    "cudasnap/_autoload/sitecustomize.py",     # transparent mode at interpreter start
    "cudasnap/integrations/_owner.py",         # the Lightning / HF callbacks' defaults
    "cudasnap/integrations/hf_resume.py",      # the HF resume helper
    "cudasnap/integrations/torchtitan.py",     # the torchtitan checkpointer
    "cudasnap/distributed/inprocess.py",       # InProcessRestart (a user's wrapper)
    "cudasnap/demo/train.py",                  # the demo script
}


def from_env_calls(source: str) -> list[int]:
    """Lines of every ``Settings.from_env(...)`` call (``config.Settings.from_env`` too)."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "from_env" and ast.unparse(n.func.value).split(".")[-1] == "Settings"]


def test_the_scan_sees_a_call() -> None:
    src = ("from cudasnap.config import Settings\nimport cudasnap.config as c\n"
           "a = Settings.from_env()\nb = c.Settings.from_env({})\nd = Policy.from_env()\n"
           "def f():\n    return Settings.from_env().wait_s\n")
    assert from_env_calls(src) == [3, 4, 7]


def test_settings_are_read_at_entry_points_only() -> None:
    calls = {str(f.relative_to(REPO)): from_env_calls(f.read_text())
             for f in sorted(PKG.rglob("*.py"))}
    calls = {rel: lines for rel, lines in calls.items() if lines and rel != "cudasnap/config.py"}
    leaf = {rel: lines for rel, lines in calls.items() if rel not in ENTRY_POINTS}
    assert not leaf, ("Settings.from_env() outside an entry point: receive the values (or the "
                      f"Settings) from the caller instead: {leaf}")
    gone = ENTRY_POINTS - set(calls)
    assert not gone, f"{sorted(gone)} call Settings.from_env() no more: drop them from ENTRY_POINTS"
    assert len(ENTRY_POINTS) <= 15  # a short list: a new reader is a leaf until argued otherwise
