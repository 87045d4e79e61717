"""Loaded by ``cudasnap run --auto`` (this folder is put first on PYTHONPATH).

Installs cudasnap's transparent mode when CUDASNAP_AUTO=1, then runs any
other ``sitecustomize`` further down the path, so an existing one still works.
"""
import importlib.util
import os
import sys

try:
    from cudasnap.config import Settings

    _auto = Settings.from_env().auto
except Exception as e:  # never break the user's program at start-up  # noqa: BLE001
    sys.stderr.write(f"cudasnap: transparent mode not installed: {e}\n")
    _auto = False
if _auto:
    try:
        import cudasnap.tools.auto

        cudasnap.tools.auto.install()
    except Exception as e:  # never break the user's program at start-up
        sys.stderr.write(f"cudasnap: transparent mode not installed: {e}\n")

_here = os.path.dirname(os.path.abspath(__file__))
for _p in sys.path:
    if _p and os.path.abspath(_p) != _here:
        _f = os.path.join(_p, "sitecustomize.py")
        if os.path.isfile(_f):
            _spec = importlib.util.spec_from_file_location("_user_sitecustomize", _f)
            if _spec and _spec.loader:
                _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
            break
