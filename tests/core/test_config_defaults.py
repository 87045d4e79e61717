"""Each option's default is written once, in cudasnap/config.py (issue 47 item 4).

The Settings fields and ``Settings.from_env`` use config's constants (no literal default,
no ``or`` fallback), the flush bounds of the facade and the flusher are config's, and the
two tables of config.py's docstring (the variables, the Snapshotter keywords) say the
defaults the code uses.
"""
from __future__ import annotations

import ast
import inspect
import re
import socket
from pathlib import Path

from cudasnap import config as cfg
from cudasnap.config import Settings

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "cudasnap" / "config.py"
DOC = CONFIG.read_text().partition('"""\nfrom __future__')[0]


def _settings_class(tree: ast.Module) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")


def _number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def literal_defaults(source: str) -> list[str]:
    """Where config.py writes a default again instead of naming its constant: a Settings
    field defaulting to a number or a string, a number handed to an ``env_*`` parser or
    ``_float`` as the default, an ``x or <literal>`` fallback in ``from_env``."""
    cls = _settings_class(ast.parse(source))
    bad: list[str] = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and node.value is not None and (
                _number(node.value) and node.value.value != 0 or
                isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) or
                isinstance(node.value, ast.Call)):
            bad.append(f"{node.lineno}: field {ast.unparse(node.target)} = {ast.unparse(node.value)}")
    from_env = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "from_env")
    for node in ast.walk(from_env):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "env_float", "env_int", "_float") and len(node.args) > 2 and _number(node.args[2]):
            bad.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and any(
                isinstance(v, ast.Constant) for v in node.values):
            bad.append(f"{node.lineno}: {ast.unparse(node)}")
    return bad


def test_the_scan_sees_a_default_written_again() -> None:
    src = CONFIG.read_text()
    assert literal_defaults(src) == []
    again = src.replace("poll_s: float = POLL_S", "poll_s: float = 1.0").replace(
        '_float(e, "CUDASNAP_WAIT_S", WAIT_S)', 'env_float(e, "CUDASNAP_WAIT_S", 120.0) or 120.0')
    found = literal_defaults(again)
    assert len(found) == 3 and "poll_s = 1.0" in found[0] and "120.0" in found[1], found


def test_settings_defaults_are_configs_constants() -> None:
    s = Settings()
    assert Settings.from_env({}) == s
    assert (s.shm_dir, s.poll_s, s.wait_s, s.peer_timeout_s, s.flush_timeout_s,
            s.pg_timeout_s, s.restart, s.rank, s.world_size, s.device_staging, s.rng_restore) == (
        cfg.SHM_DIR, cfg.POLL_S, cfg.WAIT_S, cfg.PEER_TIMEOUT_S, cfg.FLUSH_TIMEOUT_S,
        cfg.PG_TIMEOUT_S, cfg.RESTART, cfg.RANK, cfg.WORLD_SIZE, cfg.DEVICE_STAGING,
        cfg.RNG_RESTORE)


def test_the_flush_bounds_are_written_once() -> None:
    """Snapshotter.flush / flush_if_new and the Flusher's: config's FLUSH_WAIT_S and
    FINAL_FLUSH_WAIT_S (before: 30.0 and 60.0 written in snapshotter.py, flush.py and
    distributed/local.py)."""
    from cudasnap.core.flush import Flusher
    from cudasnap.snapshotter import Snapshotter

    for cls in (Snapshotter, Flusher):
        assert inspect.signature(cls.flush).parameters["timeout"].default == cfg.FLUSH_WAIT_S
        assert inspect.signature(cls.flush_if_new).parameters["wait_s"].default == \
            cfg.FINAL_FLUSH_WAIT_S
    for rel in ("cudasnap/snapshotter.py", "cudasnap/core/flush.py", "cudasnap/distributed/local.py"):
        floats = [n.lineno for n in ast.walk(ast.parse((REPO / rel).read_text()))
                  if isinstance(n, ast.Constant) and type(n.value) is float]
        assert not floats, f"{rel}: a float literal on lines {floats}: name config's constant"


# ------------------------------------------------------------------ the docstring's tables
def _table(after: str, doc: str = DOC) -> list[list[str]]:
    """Rows (split on the column rules) of the docstring table that follows ``after``."""
    start = doc.index("=" * 10, doc.index(after))
    lines = doc[start:].splitlines()
    rule = lines[0]
    cols = [(m.start(), m.end()) for m in re.finditer(r"=+", rule)]
    end = next(i for i, ln in enumerate(lines[3:], 3) if ln.startswith("=" * 10))
    rows = []
    for ln in lines[3:end]:
        cells = [ln[a:b if i < len(cols) - 1 else None].strip() for i, (a, b) in enumerate(cols)]
        if cells[0]:
            rows.append(cells)
    return rows


def _value(text: str) -> object:
    """A table cell's default as a value, or None when the cell is words ("unset", "see
    right", "from DIR", ...)."""
    t = text.split(" (")[0].strip()
    m = re.fullmatch(r"(\d+) MiB", t)
    if m:
        return int(m.group(1)) << 20
    if re.fullmatch(r"-?\d+", t):
        return int(t)
    if re.fullmatch(r"-?\d+\.\d*", t):
        return float(t)
    if t in ("True", "False"):
        return t == "True"
    if re.fullmatch(r'"[^"]*"', t):
        return t.strip('"')
    if t.startswith(("/", "./")):
        return t
    return None


# Variables whose Settings field is named otherwise than CUDASNAP_<FIELD>.
FIELD_OF = {"CUDASNAP_DIR": "directory"}


def test_the_variable_table_says_the_settings_defaults(doc: str = DOC) -> None:
    s = Settings()
    checked = []
    for name, _type, default, *_ in _table("Run-time variables", doc):
        want = _value(default)
        if want is None or not name.startswith("CUDASNAP_") or name.startswith("CUDASNAP_TEST_"):
            continue
        field = FIELD_OF.get(name, name.removeprefix("CUDASNAP_").lower())
        got = getattr(s, field)
        if got is None:  # unset in Settings: the default applies where it is used
            got = getattr(cfg, field.upper())
        if isinstance(want, str) and want.startswith(("/", "./")):  # a path
            want, got = Path(want), Path(got)
        assert got == want or isinstance(got, bool) and int(got) == want, (name, default, got)
        checked.append(name)
    assert {"CUDASNAP_WAIT_S", "CUDASNAP_POLL_S", "CUDASNAP_FLUSH_TIMEOUT_S", "CUDASNAP_DIR",
            "CUDASNAP_SHM_DIR", "CUDASNAP_ARENA_SYNC_MAX_BYTES", "CUDASNAP_PG_TIMEOUT_S"} <= set(checked)


def test_the_keyword_table_says_the_signatures_defaults() -> None:
    from cudasnap.snapshotter import Snapshotter

    sig = inspect.signature(Snapshotter.__init__).parameters
    checked = []
    for keyword, default, _check, variable in _table("``Snapshotter`` keywords"):
        want = _value(default)
        if want is None or keyword not in sig:
            continue
        got = sig[keyword].default
        var = variable.split()[0]
        if got is None and var.startswith("CUDASNAP_"):  # None: the variable's default
            field = FIELD_OF.get(var, var.removeprefix("CUDASNAP_").lower())
            got = getattr(Settings(), field)
            got = getattr(cfg, field.upper()) if got is None else got
        if isinstance(want, str) and want.startswith(("/", "./")):  # a path
            want, got = Path(want), Path(str(got))
        assert got == want, (keyword, default, got)
        checked.append(keyword)
    assert {"num_slots", "keep", "spare_slot", "backend", "flush_on_close"} <= set(checked)


def test_a_wrong_row_is_seen() -> None:
    row = "CUDASNAP_WAIT_S                 float>0  120 "
    assert row in DOC
    try:
        test_the_variable_table_says_the_settings_defaults(DOC.replace(row, row.replace("120", "90 ")))
    except AssertionError as e:
        assert "CUDASNAP_WAIT_S" in str(e)
    else:
        raise AssertionError("a row saying 90 for WAIT_S=120 passed")


# ------------------------------------------------------------------------- the node id
def test_the_default_node_id_has_one_home() -> None:
    """CUDASNAP_NODE_ID unset: the host name, from config.default_node_id, for the
    replication partners, in-process restart and the liveness records alike."""
    assert Settings().node == cfg.default_node_id() == socket.gethostname()
    assert Settings.from_env({"CUDASNAP_NODE_ID": "n7"}).node == "n7"
    for rel in ("distributed/inprocess.py", "distributed/replica.py", "distributed/liveness.py"):
        src = (REPO / "cudasnap" / rel).read_text()
        assert "gethostname" not in src and "nodename" not in src, rel
