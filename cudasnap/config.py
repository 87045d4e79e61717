"""Settings: every ``CUDASNAP_*`` environment variable, parsed and validated in one place.

``Settings.from_env()`` reads the environment once and returns a frozen
``Settings``; a value that does not parse raises ``ConfigError`` naming the
variable and the value. It is not cached: each entry point (a Snapshotter, the
coordinator, ``cudasnap run``) calls it once when it starts, so a change to
``os.environ`` made in the process before one starts is seen. Keyword arguments
passed to an API always win over the environment.

Run-time variables (booleans accept 1/0, true/false, yes/no, on/off; empty = unset):

=============================== ======== ========== ==================================================
Variable                        Type     Default    Meaning
=============================== ======== ========== ==================================================
CUDASNAP_DIR                    path     ./ckpt     snapshot directory (``cudasnap run`` exports it)
CUDASNAP_JOB                    str      from DIR   job id: names the arena and the store keys
CUDASNAP_SHM_DIR                path     /dev/shm   where the staging arena lives
CUDASNAP_HEALTH                 bool     unset      1: start the guard (signals, NVML, watchdog) in every
                                                    Snapshotter; 0: off also in the integrations
CUDASNAP_WATCHDOG_S             float>0  unset      hang watchdog: no boundary for T s -> trigger "hang"
CUDASNAP_POLL_S                 float>0  1          NVML poll interval
CUDASNAP_INJECT                 str      unset      scripted faults instead of NVML ("xid=79@step=40")
CUDASNAP_POLICY                 str      unset      trigger policy overrides ("thermal=flush,...")
CUDASNAP_WAIT_S                 float>0  120        bound of every wait on a copy (fences, close)
CUDASNAP_FRESH                  bool     0          move existing snapshots aside, start at step 0
CUDASNAP_ALLOW_FOREIGN_OWNER    bool     0          load snapshot files owned by another user
CUDASNAP_REQUIRE_RESUME         bool     0          refuse to start over at step 0 when the job made
                                                    progress that no rank can restore
CUDASNAP_ALLOW_TORCH_MISMATCH   bool     0          load an extension built for another torch
CUDASNAP_RNG_RESTORE            str      see right  RNG states put back at the restore and again at the first
                                                    forward (first_forward, default) or at the restore only
CUDASNAP_PEER_TIMEOUT_S         float>0  10         a silent peer rank is dead after this
CUDASNAP_FLUSH_TIMEOUT_S        float>0  25         every wait of a distributed flush round ends by then
CUDASNAP_RESTART                int>=0   0          restart attempt (``cudasnap run``; torchrun's
                                                    TORCHELASTIC_RESTART_COUNT wins)
CUDASNAP_SUPERVISED             bool     0          set by ``cudasnap run`` in its child
CUDASNAP_SUPERVISOR_PID         int>=0   unset      set by ``cudasnap run`` in each attempt: its pid (a
                                                    later run finds a dead supervisor's orphan by it)
CUDASNAP_RUN_VERDICT            path     unset      set by ``cudasnap run``: where an attempt records a
                                                    configuration error (the supervisor stops on it)
CUDASNAP_AUTO                   bool     0          transparent mode (``cudasnap._autoload``)
CUDASNAP_STATE_DIR              path     see right  this host's lock, directory id and flush log of an
                                                    object-store URL (default
                                                    ``$XDG_CACHE_HOME/cudasnap``, ``~/.cache/cudasnap``)
CUDASNAP_S3_ENDPOINT            url      unset      S3 endpoint of ``s3://`` directories
                                                    (``http(s)://host:port``; default: AWS)
CUDASNAP_ARENA_SYNC_MAX_BYTES   int>=0   16 MiB     arenas up to this size are made on the training thread
CUDASNAP_OVERHEAD_BUDGET        float>=0 auto       share of step time snapshots may cost; the cadence
                                                    (every k-th boundary) follows it (0: every boundary;
                                                    auto: 0.01 on the CUDA backend, 0 on the CPU one)
CUDASNAP_DEVICE_STAGING         int|auto 0          device staging buffer (snapshot-then-offload), bytes;
                                                    auto: up to half the free device memory; 0: off
CUDASNAP_NODE_REPLICA           see right 0         node-loss protection: 1 (each rank's newest COMPLETE
                                                    snapshot is copied in the background into the shared
                                                    memory of a partner rank on another node) or xor:K
                                                    (XOR parity over groups of K nodes instead of full
                                                    copies; cudasnap.distributed.replica, dist.parity; README
                                                    "Node loss")
CUDASNAP_NODE_ID                str      hostname   this process's node (partners are chosen by node;
                                                    set it to tell "nodes" on one host apart)
CUDASNAP_CONTROL                host:port unset     in-process restart: the control store (a TCPStore
                                                    no rank hosts; cudasnap.distributed.inprocess)
CUDASNAP_UID                    int>=0   unset      in-process restart: this process's id (ranks 0..W-1,
                                                    then the spares)
CUDASNAP_WORLD                  int>0    unset      in-process restart: the ranks of a generation
CUDASNAP_NPROC                  int>0    WORLD      in-process restart: ranks + spares
CUDASNAP_PG_TIMEOUT_S           float>0  10         in-process restart: the process group's timeout (the
                                                    bound on a rank stuck in a collective with a lost peer)
CUDASNAP_REPLICA_ADDR           str      see right  address the replica server listens on and publishes
                                                    (default: this host's address on the route to
                                                    MASTER_ADDR, else 127.0.0.1)
CUDASNAP_REPLICA_MAX_MBPS       float>0  unset      cap of the replication send rate (MB/s; unset: none)
CUDASNAP_TEST_KILL_AT           str      unset      tests only: SIGKILL at a commit-path phase (``phase[@n]``)
CUDASNAP_TEST_DIE_IN_FLUSH      str      unset      tests only: ``RANK[:MIN_STEP]`` dies inside a flush round
=============================== ======== ========== ==================================================

Build-time variables (read by setup.py only): CUDASNAP_CUDA_ARCHS, CUDASNAP_REQUIRE_CUDA,
CUDASNAP_WITH_CUDA, CUDASNAP_BUILD_DIR, CUDASNAP_RECONFIGURE. Test-only fault hooks
(``cudasnap._testing``, loaded through ``cudasnap._points`` when one is set):
CUDASNAP_TEST_KILL_AT, CUDASNAP_TEST_DIE_IN_FLUSH.

``Snapshotter`` keywords: defaults and checks (``check_options``, ``check_fresh_url``,
``resolve_threads``); a keyword given wins over its variable. Each bad value is one
``ConfigError`` naming it, raised before anything is made.

==================== =================== ========================= =============================
Keyword              Default             Check                     Variable
==================== =================== ========================= =============================
num_slots            2 (NUM_SLOTS)       int, 2 .. 8 - spare_slot  -
spare_slot           True                -                         -
keep                 3 (KEEP)            int >= 0 (0: keep all)    -
chunk_bytes          None (auto: 1/4     None, multiple of 4096    - (core.slot_geometry)
                     of state, <= 4 MiB)
backend              "auto"              one of BACKENDS           - (auto: Backend.resolve)
snapshot_every       None (budget)       int >= 1 (fixes k)        -
overhead_budget      None (auto: 0.01    0 <= float < 1            CUDASNAP_OVERHEAD_BUDGET
                     CUDA, 0 CPU)
device_staging       0 (off)             int >= 0 or "auto"        CUDASNAP_DEVICE_STAGING
rng_sources          RNG_SOURCES         a subset of RNG_SOURCES   -
rng_restore          "first_forward"     one of RNG_RESTORE_POINTS CUDASNAP_RNG_RESTORE
copy_threads         cores - 1, 1 .. 4   -                         - (resolve_threads)
flush_threads        cores, 2 .. 8       -                         - (resolve_threads)
directory            ./ckpt              URL: not with fresh       CUDASNAP_DIR
fresh                False               see directory             CUDASNAP_FRESH
shm_dir              /dev/shm            -                         CUDASNAP_SHM_DIR
job                  from directory      -                         CUDASNAP_JOB
health / watchdog_s  see the variables   -                         CUDASNAP_HEALTH / _WATCHDOG_S
allow_foreign_owner  False               -                         CUDASNAP_ALLOW_FOREIGN_OWNER
require_resume       False               -                         CUDASNAP_REQUIRE_RESUME
arena_sync_max_bytes 16 MiB              -                         CUDASNAP_ARENA_SYNC_MAX_BYTES
node_replica         False               node_replica_mode         CUDASNAP_NODE_REPLICA
rank / world_size    torch.distributed   -                         RANK / WORLD_SIZE
distributed          world_size > 1      -                         -
replicas             "auto"              dist.groups               -
policy / inject      none                triggers.policy / inject  CUDASNAP_POLICY / _INJECT
flush_on_close       True                -                         -
extra                None                -                         -
==================== =================== ========================= =============================
"""
from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .env_parse import _FALSE, _TRUE, _path, _raw, env_bool, env_float, env_int, env_url
from .errors import ConfigError

# Snapshotter keyword defaults (see the table above).
NUM_SLOTS = 2
KEEP = 3
CHUNK_BYTES = 4 << 20  # the largest automatic chunk (chunk_bytes=None: core.slot_geometry)
BACKENDS = ("auto", "cpu", "cuda")
RNG_SOURCES = ("torch", "cuda", "numpy", "python")
RNG_RESTORE_POINTS = ("first_forward", "restore")  # core.rng.RestoredRng; the 1st: default
MAX_SLOTS = 8  # the arena header's slot table
OVERHEAD_BUDGET = 0.01  # share of step time snapshots may cost (core.cadence; CUDA backend)
MAX_EVERY = 64  # the budget's largest k: a process killed outright replays at most this many
FLUSH_WAIT_S = 30.0  # Snapshotter.flush(timeout=): bound of each wait on the way down
FINAL_FLUSH_WAIT_S = 60.0  # close()'s final flush / flush_if_new: wait for the running copy

# Environment defaults (the table above; Settings and from_env use these: test_config_defaults).
DIRECTORY = "ckpt"  # CUDASNAP_DIR unset: ./ckpt
SHM_DIR = Path("/dev/shm")
POLL_S = 1.0
WAIT_S = 120.0
PEER_TIMEOUT_S = 10.0
FLUSH_TIMEOUT_S = 25.0
PG_TIMEOUT_S = 10.0
RESTART = 0
RANK = 0
WORLD_SIZE = 1
ARENA_SYNC_MAX_BYTES = 16 << 20  # arenas whose slots hold at most this: made on the training thread
DEVICE_STAGING = 0  # off
RNG_RESTORE = RNG_RESTORE_POINTS[0]


def default_node_id() -> str:
    """This host's name: a process's node when CUDASNAP_NODE_ID is unset (one home)."""
    return socket.gethostname()


def check_options(*, num_slots: int, spare_slot: bool, keep: Any, chunk_bytes: int | None,
                  backend: str, snapshot_every: Any, rng_sources: tuple[str, ...],
                  overhead_budget: Any = None, device_staging: Any = None) -> None:
    """Raises ConfigError naming the first bad Snapshotter keyword."""
    if snapshot_every is not None and (isinstance(snapshot_every, bool) or not isinstance(
            snapshot_every, int) or snapshot_every < 1):
        raise ConfigError(f"snapshot_every must be an int >= 1 (or None: the overhead budget "
                          f"picks it), got {snapshot_every!r}")
    if overhead_budget is not None:
        check_budget(overhead_budget, "overhead_budget")
    if device_staging is not None:
        check_staging(device_staging, "device_staging")
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 2:
        raise ConfigError(f"num_slots must be an int >= 2, got {num_slots!r}")
    if num_slots + bool(spare_slot) > MAX_SLOTS:
        raise ConfigError(f"num_slots must be <= {MAX_SLOTS - bool(spare_slot)} (the arena "
                          f"holds at most {MAX_SLOTS} slots, spare_slot={bool(spare_slot)}), "
                          f"got {num_slots}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ConfigError(f"keep must be an int >= 0 (0 keeps every snapshot), got {keep!r}")
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(
            chunk_bytes, int) or chunk_bytes < 4096 or chunk_bytes % 4096):
        raise ConfigError(f"chunk_bytes must be a positive multiple of 4096 (or None: it "
                          f"follows the state), got {chunk_bytes!r}")
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")
    bad = set(rng_sources) - set(RNG_SOURCES)
    if bad:
        raise ConfigError(f"unknown rng_sources {sorted(bad)}; use torch, cuda, numpy, python")


def check_rng_restore(v: Any, name: str) -> str:
    """``rng_restore``: one of RNG_RESTORE_POINTS."""
    if v not in RNG_RESTORE_POINTS:
        raise ConfigError(f"{name} must be one of {', '.join(RNG_RESTORE_POINTS)}, got {v!r}")
    return str(v)


def check_budget(v: Any, name: str) -> float:
    """``overhead_budget``: a share of step time, 0 <= v < 1 (0: snapshot every boundary)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise ConfigError(f"{name} must be a number >= 0 and < 1 (a share of step time; 0: "
                          f"every boundary), got {v!r}")
    return float(v)


def check_staging(v: Any, name: str) -> int | str:
    """``device_staging``: bytes (int >= 0; 0: off) or "auto"."""
    if v == "auto":
        return "auto"
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{name} must be a number of bytes >= 0 (0: off) or 'auto', got {v!r}")
    return v


def check_fresh_url(directory: Any, url: bool, fresh: bool) -> None:
    """An object-store URL (``url``: ``cudasnap.format.paths.is_url``) is never moved
    aside: ``fresh`` is refused, at any world size.

    Why refuse rather than move: an object store has no rename, so "aside" would be a
    copy of every object under ``.old-<time>/`` and a delete of the originals, one
    object at a time: minutes for a large snapshot, and a start killed half-way leaves
    the old steps half copied and half deleted. The fresh start (storage.fresh.move_aside)
    moves local files only. A new URL prefix is a fresh start that costs nothing and
    loses nothing."""
    if url and fresh:
        raise ConfigError(f"{directory}: fresh=True (CUDASNAP_FRESH, cudasnap run --fresh) "
                          "cannot move object-store snapshots aside (no rename in an object "
                          "store); start fresh under a new URL prefix instead, e.g. "
                          f"{str(directory).rstrip('/')}-2")


def resolve_threads(copy_threads: int | None, flush_threads: int | None,
                    cores: int | None = None) -> tuple[int, int]:
    """The "auto" (None or 0) thread counts, resolved once: the copy engine leaves a core
    to the training thread (1 .. 4), the flusher takes the cores (2 .. 8)."""
    n = cores or os.cpu_count() or 2
    return (copy_threads or max(1, min(4, n - 1)), flush_threads or min(8, max(2, n)))


def resolve_rank(rank: int | None, world_size: int | None, env: Settings
                 ) -> tuple[int, int, bool]:
    """(rank, world size, torch.distributed is initialised): the keywords, else the
    initialised process group's, else the launcher's (RANK / WORLD_SIZE)."""
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    r = rank if rank is not None else dist.get_rank() if on else env.rank
    w = world_size if world_size is not None else dist.get_world_size() if on else env.world_size
    return r, w, on


@dataclass(frozen=True)
class Settings:
    directory: str | None = None
    job: str | None = None
    shm_dir: Path = SHM_DIR
    health: bool | None = None
    watchdog_s: float | None = None
    poll_s: float = POLL_S
    inject: str | None = None
    policy: str | None = None
    wait_s: float = WAIT_S
    fresh: bool = False
    allow_foreign_owner: bool = False
    require_resume: bool = False
    rng_restore: str = RNG_RESTORE
    allow_torch_mismatch: bool = False
    peer_timeout_s: float = PEER_TIMEOUT_S
    flush_timeout_s: float = FLUSH_TIMEOUT_S
    restart: int = RESTART
    supervised: bool = False
    supervisor_pid: int | None = None
    run_verdict: str | None = None
    auto: bool = False
    # helper C: object-store directories (cudasnap.storage.fsspec)
    state_dir: Path | None = None
    s3_endpoint: str | None = None
    # core: read by the Snapshotter (its keyword arguments win). RANK / WORLD_SIZE: the
    # launcher's rank and world size when torch.distributed is not initialised;
    # CUDASNAP_ARENA_SYNC_MAX_BYTES (int>=0): arenas up to this size are made on the
    # training thread (None: ARENA_SYNC_MAX_BYTES).
    rank: int = RANK
    world_size: int = WORLD_SIZE
    arena_sync_max_bytes: int | None = None
    overhead_budget: float | None = None  # None: auto (core.cadence)
    device_staging: int | str = DEVICE_STAGING
    # node-loss replication (cudasnap.distributed.replica): off by default
    node_replica: bool = False
    node_parity: int = 0  # node_replica="xor:K": K (groups of K nodes); 0: full copies
    node_id: str | None = None  # None: default_node_id() (the ``node`` property)
    replica_addr: str | None = None
    replica_max_mbps: float | None = None
    # in-process restart (cudasnap.distributed.inprocess)
    control: str | None = None
    uid: int | None = None
    world: int | None = None
    nproc: int | None = None
    pg_timeout_s: float = PG_TIMEOUT_S
    # test-only: CUDASNAP_TEST_KILL_AT or CUDASNAP_TEST_DIE_IN_FLUSH is set, so the fault
    # hooks of cudasnap._testing are loaded for this process (cudasnap._points)
    test_hooks: bool = False

    @property
    def first_of_job(self) -> bool:
        """Rank 0 of the first attempt: the process that says a job-wide thing once."""
        return self.restart == 0 and self.rank == 0

    @property
    def node(self) -> str:
        """This process's node: CUDASNAP_NODE_ID, else :func:`default_node_id`."""
        return self.node_id or default_node_id()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        replica = _replica_env(e)  # 0, 1 or K (xor:K)
        return cls(
            directory=_raw(e, "CUDASNAP_DIR"),
            job=_raw(e, "CUDASNAP_JOB"),
            shm_dir=_path(_raw(e, "CUDASNAP_SHM_DIR")) or SHM_DIR,
            health=env_bool(e, "CUDASNAP_HEALTH"),
            watchdog_s=env_float(e, "CUDASNAP_WATCHDOG_S"),
            poll_s=_float(e, "CUDASNAP_POLL_S", POLL_S),
            inject=_raw(e, "CUDASNAP_INJECT"),
            policy=_raw(e, "CUDASNAP_POLICY"),
            wait_s=_float(e, "CUDASNAP_WAIT_S", WAIT_S),
            fresh=bool(env_bool(e, "CUDASNAP_FRESH")),
            allow_foreign_owner=bool(env_bool(e, "CUDASNAP_ALLOW_FOREIGN_OWNER")),
            require_resume=bool(env_bool(e, "CUDASNAP_REQUIRE_RESUME")),
            rng_restore=check_rng_restore(_raw(e, "CUDASNAP_RNG_RESTORE") or RNG_RESTORE,
                                          "CUDASNAP_RNG_RESTORE"),
            allow_torch_mismatch=allowed("CUDASNAP_ALLOW_TORCH_MISMATCH", e),
            peer_timeout_s=_float(e, "CUDASNAP_PEER_TIMEOUT_S", PEER_TIMEOUT_S),
            flush_timeout_s=_float(e, "CUDASNAP_FLUSH_TIMEOUT_S", FLUSH_TIMEOUT_S),
            restart=env_int(e, "TORCHELASTIC_RESTART_COUNT", env_int(e, "CUDASNAP_RESTART", RESTART)),
            supervised=bool(env_bool(e, "CUDASNAP_SUPERVISED")),
            supervisor_pid=_opt_int(e, "CUDASNAP_SUPERVISOR_PID"),
            run_verdict=run_verdict_path(e),
            auto=bool(env_bool(e, "CUDASNAP_AUTO")),
            # helper C
            state_dir=_path(_raw(e, "CUDASNAP_STATE_DIR")),
            s3_endpoint=env_url(e, "CUDASNAP_S3_ENDPOINT"),
            # core
            rank=env_int(e, "RANK", RANK),
            world_size=env_int(e, "WORLD_SIZE", WORLD_SIZE),
            arena_sync_max_bytes=_opt_int(e, "CUDASNAP_ARENA_SYNC_MAX_BYTES"),
            overhead_budget=_budget_env(e),
            device_staging=_staging_env(e),
            test_hooks=test_hooks_asked(e),
            node_replica=replica >= 1,
            node_parity=replica if replica >= 2 else 0,
            node_id=_raw(e, "CUDASNAP_NODE_ID"),
            replica_addr=_raw(e, "CUDASNAP_REPLICA_ADDR"),
            replica_max_mbps=env_float(e, "CUDASNAP_REPLICA_MAX_MBPS"),
            control=_raw(e, "CUDASNAP_CONTROL"),
            uid=_opt_int(e, "CUDASNAP_UID"),
            world=_opt_int(e, "CUDASNAP_WORLD"),
            nproc=_opt_int(e, "CUDASNAP_NPROC"),
            pg_timeout_s=_float(e, "CUDASNAP_PG_TIMEOUT_S", PG_TIMEOUT_S),
        )


def test_hooks_asked(env: Mapping[str, str] | None = None) -> bool:
    """CUDASNAP_TEST_KILL_AT or CUDASNAP_TEST_DIE_IN_FLUSH is set (alone: read at import by
    _points, where a malformed other variable must not fail the import)."""
    e = os.environ if env is None else env
    return any(_raw(e, v) is not None for v in ("CUDASNAP_TEST_KILL_AT", "CUDASNAP_TEST_DIE_IN_FLUSH"))


def allowed(name: str, env: Mapping[str, str] | None = None) -> bool:
    """A safety switch alone, where no caller hands it down: ALLOW_TORCH_MISMATCH (the first
    load, _native), ALLOW_FOREIGN_OWNER (a read whose caller did not say, storage.safe_io)."""
    assert name in ("CUDASNAP_ALLOW_TORCH_MISMATCH", "CUDASNAP_ALLOW_FOREIGN_OWNER"), name
    return bool(env_bool(os.environ if env is None else env, name))


def run_verdict_path(env: Mapping[str, str] | None = None) -> str | None:
    """CUDASNAP_RUN_VERDICT alone: read where the rest of the environment may be the
    configuration error being reported (cudasnap.tools.standby.write_verdict)."""
    return _raw(os.environ if env is None else env, "CUDASNAP_RUN_VERDICT")


def _float(env: Mapping[str, str], name: str, default: float) -> float:  # env_float, typed
    v = env_float(env, name)
    return default if v is None else v


def _opt_int(env: Mapping[str, str], name: str) -> int | None:  # core
    return env_int(env, name, 0) if _raw(env, name) is not None else None


def _budget_env(env: Mapping[str, str]) -> float | None:  # core
    v = _raw(env, "CUDASNAP_OVERHEAD_BUDGET")
    if v is None or v.lower() == "auto":
        return None
    try:
        return check_budget(float(v), "CUDASNAP_OVERHEAD_BUDGET")
    except ValueError:
        raise ConfigError(f"environment variable CUDASNAP_OVERHEAD_BUDGET={v!r} is not a "
                          "number") from None


def node_replica_mode(value: object) -> int:
    """``node_replica`` as 0 (off), 1 (full copies on a partner node) or K >= 2 (XOR parity
    over groups of K nodes): False/True, 0/1, "copy", "xor:K"; ConfigError otherwise."""
    if isinstance(value, bool) or value is None:
        return int(bool(value))
    v = str(value).strip().lower()
    if v in _FALSE or v == "":
        return 0
    if v in _TRUE or v == "copy":
        return 1
    m = re.fullmatch(r"xor:(\d+)", v)
    if m and 2 <= int(m.group(1)) <= 64:
        return int(m.group(1))
    raise ConfigError(f"node_replica={value!r}: use 1 (full copies on a partner node), "
                      "\"xor:K\" with 2 <= K <= 64 (XOR parity over groups of K nodes), or 0")


def arena_slots(num_slots: int, spare_slot: bool, world_size: int, node_replica: object,
                env_parity: int) -> int:
    """Slots of a rank's arena: ``num_slots``, the spare one (snapshots go on while a flush
    holds a slot), and with XOR parity (``node_replica`` "xor:K", else the environment's)
    one more: the slot of the step the parity encodes stays leased until the next round
    completed (two leases during a round), and snapshots must never stop for it."""
    parity = node_replica_mode(node_replica) if node_replica is not None else env_parity
    n = num_slots + (1 if spare_slot else 0) + (1 if world_size > 1 and parity >= 2 else 0)
    if n > MAX_SLOTS:
        raise ConfigError(f"num_slots={num_slots} with {'the spare slot and ' if spare_slot else ''}"
                          f"XOR parity's leased slot needs {n} slots; an arena holds at most "
                          f"{MAX_SLOTS}")
    return n


def _replica_env(env: Mapping[str, str]) -> int:
    return node_replica_mode(_raw(env, "CUDASNAP_NODE_REPLICA"))


def _staging_env(env: Mapping[str, str]) -> int | str:  # core
    v = _raw(env, "CUDASNAP_DEVICE_STAGING")
    if v is not None and v.lower() == "auto":
        return "auto"
    return env_int(env, "CUDASNAP_DEVICE_STAGING", DEVICE_STAGING)
