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


def test_every_snapshotter_keyword_has_a_row_in_the_keyword_table():
    """config.py is the one home of the options: each Snapshotter keyword (bar the objects
    it snapshots) has a row, and the signature's defaults are config's constants."""
    import inspect

    from cudasnap import config as cfg
    from cudasnap.snapshotter import Snapshotter

    doc = (REPO / "cudasnap" / "config.py").read_text().partition('"""\nfrom __future__')[0]
    table = doc[doc.index("==================== ", doc.index("keywords")):].splitlines()
    width = len(table[0].split(" ")[0])  # the keyword column, from its rule
    rows = {n.strip() for line in table[3:] if line and not line.startswith("=")
            for n in line[:width].split("/")}
    sig = inspect.signature(Snapshotter.__init__).parameters
    keywords = set(sig) - {"self", "model", "optimizer"}
    assert keywords <= rows, sorted(keywords - rows)
    assert (sig["num_slots"].default, sig["keep"].default, sig["chunk_bytes"].default,
            sig["rng_sources"].default) == (cfg.NUM_SLOTS, cfg.KEEP, None, cfg.RNG_SOURCES)


@pytest.mark.parametrize("kw, bad", [("num_slots", 1), ("num_slots", 8), ("num_slots", 2.5),
                                     ("keep", -1), ("keep", True), ("chunk_bytes", 4097),
                                     ("chunk_bytes", 0), ("backend", "tpu"),
                                     ("snapshot_every", 0), ("rng_sources", ("torch", "jax"))])
def test_check_options_names_the_bad_keyword(kw, bad):
    from cudasnap import config as cfg

    good = dict(num_slots=2, spare_slot=True, keep=3, chunk_bytes=cfg.CHUNK_BYTES,
                backend="auto", snapshot_every=1, rng_sources=cfg.RNG_SOURCES)
    cfg.check_options(**good)
    cfg.check_options(**{**good, "chunk_bytes": None})  # None: the chunk follows the state
    with pytest.raises(ConfigError, match=kw):
        cfg.check_options(**{**good, kw: bad})


def test_fresh_url_and_auto_threads():
    from cudasnap import config as cfg

    cfg.check_fresh_url("s3://b/p", True, False)
    cfg.check_fresh_url("/tmp/x", False, True)
    with pytest.raises(ConfigError, match="s3://b/p-2"):
        cfg.check_fresh_url("s3://b/p", True, True)
    assert cfg.resolve_threads(None, None, cores=2) == (1, 2)
    assert cfg.resolve_threads(None, None, cores=16) == (4, 8)
    assert cfg.resolve_threads(3, 5, cores=16) == (3, 5)
