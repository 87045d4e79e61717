"""Where a resumed Hugging Face ``Trainer`` run starts: the snapshot's ``TrainerState``
as a small HF checkpoint folder (cudasnap.integrations.hf).

:func:`newest_host_state` finds the newest snapshot this rank can restore (its arena's
COMPLETE slots first, then the stored steps; several ranks: committed steps with this
rank's files, and the newest step every rank holds, agreed over the process group as the
restore's vote picks it); :func:`write_folder` writes the folder
``trainer.train(resume_from_checkpoint=...)`` reads: ``trainer_state.json`` and an empty
weights placeholder (the weights come from the snapshot at ``on_train_begin``).
"""
from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import Settings
from ..errors import SnapshotError
from ..format import codec, paths
from ..storage import listing, posix

log = logging.getLogger("cudasnap.hf")

RESUME_DIR = "hf-resume"
_MISSING_KEYS_MSG = "There were missing keys in the checkpoint model loaded"


class DropPlaceholderWarning(logging.Filter):
    """The Trainer's warning about every key missing from the empty placeholder."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_MISSING_KEYS_MSG)


def newest_host_state(d: Path, kw: Mapping[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """(step, decoded host state) of the newest snapshot this rank can restore, shared
    memory first. Several ranks: the newest step every rank holds (each rank's arena
    slots and the committed steps with its files, agreed over the process group), as
    the restore's vote picks it: ranks whose newest slots differ (one was killed
    between two boundaries) then resume at the same global step."""
    found = _local_host_states(d, kw)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        step = agree_step(sorted(found, reverse=True))
        if step is None:
            return None
        return step, codec.decode(found[step](), "host")
    if not found:
        return None
    step = max(found)
    return step, codec.decode(found[step](), "host")


def _local_host_states(d: Path, kw: Mapping[str, Any]) -> dict[int, Callable[[], Any]]:
    """{step: a reader of its encoded host state} of every snapshot this rank holds: the
    COMPLETE slots of its arena, then (several ranks: committed only, its own
    manifest; a step one rank flushed alone is not restorable) the stored steps."""
    from .._native import native

    out: dict[int, Callable[[], Any]] = {}
    if not d.is_dir():
        return out
    cfg = Settings.from_env()
    job = kw.get("job") or cfg.job or paths.job_id(d)
    rank = kw.get("rank")
    rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
    shm = Path(kw.get("shm_dir") or cfg.shm_dir)
    arena_path = paths.arena_path(shm, job, rank)
    if arena_path.exists():
        try:
            arena = native().Arena.open(str(arena_path), False)
            for slot in range(arena.num_slots):
                info = arena.slot_info(slot)
                if info["valid"]:
                    meta: dict[str, Any] = json.loads(arena.read_meta(slot))
                    out.setdefault(int(info["step"]), functools.partial(meta.get, "host"))
        except (SnapshotError, ValueError, KeyError) as e:
            log.warning("cannot read the staging arena %s: %s", arena_path, e)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    stored = listing.committed_steps(d) if world > 1 else posix.list_snapshots(d)
    for s in stored:
        if s.step in out:
            continue
        mpath = s.path / paths.rank_dirname(rank) / "manifest.json" if world > 1 \
            else s.manifest_path

        def host(mpath: Path = mpath) -> Any:
            man = posix.load_manifest(mpath)
            if int(man.get("world_size", 1) or 1) != world:
                raise SnapshotError(f"{mpath}: written by {man.get('world_size')} ranks, "
                                    f"this job has {world}")
            return man["host"]
        if mpath.is_file():
            out[s.step] = host
    return out


def write_folder(d: Path, state: dict[str, Any]) -> Path:
    """``d/hf-resume``: ``trainer_state.json`` (``state``) and the empty placeholder."""
    state.setdefault("log_history", [])
    folder = d / RESUME_DIR
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = folder / f".trainer_state.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    os.replace(tmp, folder / "trainer_state.json")  # ranks may share the folder
    placeholder = folder / "model.safetensors"
    if not placeholder.exists():
        from safetensors.torch import save_file

        ptmp = folder / f".model.safetensors.tmp-{os.getpid()}"
        save_file({}, str(ptmp), metadata={"cudasnap": "placeholder: the weights come "
                                           "from the cudasnap snapshot"})
        os.replace(ptmp, placeholder)
    log.info("resuming from the cudasnap snapshot of global step %d via %s",
             int(state.get("global_step", 0)), folder)
    return folder


def agree_step(steps: list[int], limit: int = 64) -> int | None:
    """The newest of ``steps`` (this rank's, newest first) that every rank holds, over the
    default process group (a tensor all-gather: no pickle); None when none is common, or
    this rank's own newest when no process group is up (it is then checked at
    ``on_train_begin`` against the restore's vote, which refuses a disagreement)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        log.warning("resume_checkpoint(): torch.distributed is not initialised yet, so the "
                    "ranks cannot agree on a step; create the Trainer first")
        return steps[0] if steps else None
    dev = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.full((limit,), -1, dtype=torch.int64, device=dev)
    if steps:
        mine[:min(limit, len(steps))] = torch.tensor(steps[:limit], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    common = set(steps[:limit])
    for t in every:
        common &= {int(v) for v in t.cpu().tolist() if v >= 0}
    return max(common) if common else None
