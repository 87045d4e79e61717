"""The coordinator's key-value client on the c10d store.

Keys are namespaced ``cudasnap/<job>/e<epoch>/``. Two connections: one for
the peer monitor thread alone (its heartbeats never queue behind a flush's
or a restore's store traffic), one shared by every other thread under a lock.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger("cudasnap.distributed")


def csv(steps: Iterable[int]) -> str:
    return ",".join(str(s) for s in sorted(steps))


def parse_csv(v: str) -> set[int]:
    return {int(x) for x in v.split(",") if x}


def agent_store_shared(env: Mapping[str, str] | None = None) -> bool:
    """torchrun hands its workers its own rendezvous store (TORCHELASTIC_USE_AGENT_STORE)."""
    e = os.environ if env is None else env
    return e.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def store_is_per_round() -> bool:
    """torchrun without its shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which a
    replacement node needs to join): the default group's store is new per rendezvous round,
    and restart counts differ between agents (a replacement node starts at 0)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and not agent_store_shared()


def restarts_share_the_store(env: Mapping[str, str] | None = None) -> bool:
    """torchrun restarts workers in place (``--max-restarts`` > 0) on its shared rendezvous
    store (``TORCHELASTIC_USE_AGENT_STORE``, torch's default). torch 2.11 and 2.14 make that
    store once per agent and keep it across restarts, and ``init_process_group`` adds no
    per-attempt prefix: a restarted attempt can read the previous attempt's process-group
    keys (pytorch#135712). gloo then connects to the dead workers' addresses and fails, or
    waits in ``connectFullMesh`` past the group's timeout; NCCL can read a stale unique id.
    Seen with torchtitan 0.3.0 on gloo, 2026-12-06 (gdb: both restarted workers in gloo)."""
    e = os.environ if env is None else env
    try:
        restarts = int(e.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    except ValueError:
        return False
    return restarts > 0 and agent_store_shared(e)


def warn_if_restarts_share_the_store(rank: int) -> None:
    """Rank 0 says so once per attempt, with the two ways out."""
    if rank == 0 and restarts_share_the_store():
        log.warning(
            "torchrun restarts workers in place on its shared rendezvous store, which keeps "
            "the previous attempt's process-group keys (pytorch#135712): a restarted attempt "
            "can fail or hang in init_process_group before cudasnap can restore it. Run "
            "`cudasnap run -- torchrun --max-restarts=0 ...` (a fresh torchrun per attempt), "
            "or export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (the store then "
            "lives in rank 0's process: if rank 0 dies, the others cannot agree on a flush "
            "to disk; their snapshots in shared memory still resume the job)")


def store_lost(e: BaseException) -> str | None:
    """What to tell the user when ``e`` says the coordination store is unreachable (its
    server is gone); None for any other error."""
    import torch.distributed as dist

    if not isinstance(e, dist.DistNetworkError):
        return None
    where = ("it lived in rank 0's process (torchrun without its shared store: "
             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), which is gone"
             if store_is_per_round() else "its server (torchrun's agent or the launcher's "
             "store) is gone")
    return (f"cudasnap's coordination store is unreachable ({e}): {where}. No step can be "
            "agreed or committed; the snapshots in this node's shared memory stay for the "
            "next attempt")


def open_store() -> Store:
    """Our own connection for heartbeats and agreement.

    Under torchrun this is the elastic agent's TCPStore (MASTER_ADDR/PORT with
    TORCHELASTIC_USE_AGENT_STORE): it lives in the agent, outlives every
    worker, and a frozen (SIGSTOPped) or dead worker cannot hold it up — unlike
    a FileStore whose lock a stopped process may be holding. Otherwise a
    clone of the default process group's store.
    """
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if agent_store_shared() and addr and port:
        try:
            tcp = dist.TCPStore(addr, int(port), is_master=False,
                                timeout=datetime.timedelta(seconds=30))
            return dist.PrefixStore("cudasnap-coord", tcp)
        except Exception as e:  # noqa: BLE001 - fall back to the process group's store
            log.warning("agent store %s:%s unavailable (%s); using the process group's store",
                        addr, port, e)
    return dist.distributed_c10d._get_default_store().clone()


class KV:
    """get/set/compare_set under one prefix; thread-aware (see the module docstring)."""

    def __init__(self, prefix: str, store: Store | None = None,
                 monitor_store: Store | None = None) -> None:
        self.prefix = prefix
        self.store = store if store is not None else open_store()
        self.store.set_timeout(datetime.timedelta(seconds=30))
        self._lock = threading.Lock()  # one store client, several threads
        self._mon_store = monitor_store if monitor_store is not None else open_store()
        self._mon_store.set_timeout(datetime.timedelta(seconds=30))
        self.monitor_thread: threading.Thread | None = None

    def get(self, key: str) -> str | None:
        return self._op(key, None)

    def set(self, key: str, value: str) -> None:
        self._op(key, value)

    def _op(self, key: str, value: str | None) -> str | None:
        if self.monitor_thread is not None and threading.current_thread() is self.monitor_thread:
            return self._kv(self._mon_store, key, value)  # the monitor's own client
        with self._lock:
            return self._kv(self.store, key, value)

    def _kv(self, st: Store, key: str, value: str | None) -> str | None:
        if value is not None:
            st.set(self.prefix + key, value)
            return value
        if not st.check([self.prefix + key]):
            return None
        return str(st.get(self.prefix + key).decode())

    def delete(self, key: str) -> None:
        """Removes ``key`` (absent: nothing)."""
        with self._lock:
            self.store.delete_key(self.prefix + key)

    def propose(self, key: str, value: str) -> str:
        """compare_set: the first value stored under ``key`` wins; returns the winner."""
        with self._lock:
            return str(self.store.compare_set(self.prefix + key, "", value).decode() or value)

    def wait(self, key: str, timeout: float) -> str | None:
        end = time.monotonic() + timeout
        while True:
            v = self.get(key)
            if v is not None or time.monotonic() >= end:
                return v
            time.sleep(0.02)
