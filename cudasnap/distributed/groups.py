"""This process's torch.distributed process groups, for the in-process restart
(cudasnap.distributed.inprocess): forgotten without an abort (gloo), or aborted (NCCL)."""
from __future__ import annotations

import logging

log = logging.getLogger("cudasnap.inprocess")


def drop_groups() -> list[object]:
    """Every process group of this process forgotten now; returns them, to be kept.

    ``_abort_process_group()`` calls each group's ``abort()``, and gloo's waits for an
    operation still in flight (one this rank left when a peer was lost: its ring neighbour
    never sends) until the group's timeout, holding the GIL (every thread of the process
    stops: 10 s of a 4-rank recovery, measured). So the bookkeeping it does after that
    (torch.distributed's ``_world``) is done here, as it does it, and no ``abort()`` is
    called: the old groups are kept alive (a release would wait alike) until their
    operations have timed out (``InProcessRestart.close``). A torch whose ``_world``
    differs gets the blocking call. NCCL groups are aborted first: NCCL's abort does not
    wait, and frees the communicators (untested here: this machine has no GPU)."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    w = c10d._world
    for pg in nccl_groups():  # NCCL's abort does not wait (ncclCommAbort): its resources go
        try:
            pg.abort()  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - aborted already (the monitor), or gone
            log.debug("in-process restart: NCCL abort: %s", e)
    try:
        old: list[object] = list(w.pg_names)
        c10d._update_default_pg(None)
        for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config,
                      w.pg_to_tag, w.tags_to_pg, w.pg_coalesce_state):
            table.clear()
        c10d._unregister_all_process_groups()
        w.group_count = 0  # a group's name keys its store entries: a spare's count from 0 too
    except AttributeError as e:
        log.debug("in-process restart: blocking abort (%s)", e)
        c10d._abort_process_group()
        return []
    return old


def nccl_groups() -> list[object]:
    """The NCCL backends of this process's process groups (a group of several backends,
    ``cpu:gloo,cuda:nccl``, gives its NCCL one only: an abort of its gloo one would hold
    the GIL, ``drop_groups``)."""
    import torch
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    out = []
    for pg in list(getattr(c10d._world, "pg_names", {})):
        try:
            if "nccl" not in str(dist.get_backend(pg)).lower():
                continue
            out.append(pg._get_backend(torch.device("cuda")))
        except (RuntimeError, ValueError):  # dropped meanwhile by the training thread
            continue
    return out
