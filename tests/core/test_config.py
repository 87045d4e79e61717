"""cudasnap.config: every CUDASNAP_* variable parsed and validated in one place."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cudasnap.config import Settings
from cudasnap.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_defaults_when_nothing_is_set():
    s = Settings.from_env({})
    assert s == Settings()
    assert s.shm_dir == Path("/dev/shm") and s.health is None and s.peer_timeout_s == 10.0
    assert s.flush_timeout_s == 25.0 and s.wait_s == 120.0 and s.restart == 0 and not s.auto


def test_values_are_parsed():
    s = Settings.from_env({"CUDASNAP_DIR": "/x", "CUDASNAP_SHM_DIR": "/tmp/s",
                           "CUDASNAP_HEALTH": "0", "CUDASNAP_AUTO": "yes",
                           "CUDASNAP_PEER_TIMEOUT_S": "2.5", "CUDASNAP_RESTART": "3",
                           "CUDASNAP_WATCHDOG_S": " 7 ", "CUDASNAP_FRESH": "true"})
    assert (s.directory, s.shm_dir, s.health, s.auto) == ("/x", Path("/tmp/s"), False, True)
    assert (s.peer_timeout_s, s.restart, s.watchdog_s, s.fresh) == (2.5, 3, 7.0, True)


@pytest.mark.parametrize("name,value", [
    ("CUDASNAP_HEALTH", "maybe"), ("CUDASNAP_PEER_TIMEOUT_S", "ten"),
    ("CUDASNAP_FLUSH_TIMEOUT_S", "-1"), ("CUDASNAP_WAIT_S", "inf"), ("CUDASNAP_RESTART", "-2"),
    ("CUDASNAP_RESTART", "1.5"), ("CUDASNAP_ALLOW_FOREIGN_OWNER", "2"), ("CUDASNAP_POLL_S", "0")])
def test_bad_values_name_the_variable_and_the_value(name, value):
    with pytest.raises(ConfigError) as ei:
        Settings.from_env({name: value})
    assert name in str(ei.value) and repr(value) in str(ei.value)


def test_every_variable_read_by_the_settings_is_documented_in_the_table():
    src = (REPO / "cudasnap" / "config.py").read_text()
    doc, _, code = src.partition('"""\nfrom __future__')
    read = set(re.findall(r'"(CUDASNAP_[A-Z_]+)"', code))
    assert read and read <= set(re.findall(r"^(CUDASNAP_[A-Z_]+)\s", doc, re.M))
