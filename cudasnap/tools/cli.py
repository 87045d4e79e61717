"""The ``cudasnap`` command line: demo, run, inspect, verify, export, gc, health, advise."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from ..config import Settings
from ..errors import ConfigError, CorruptSnapshot, SnapshotError

log = logging.getLogger("cudasnap.cli")

EXIT_STATUS = ("exit status: 0 success; 1 verify found a damaged snapshot; 2 an error, printed "
               "as one line (bad arguments or paths, an unreadable snapshot, an unreachable "
               "object store); --debug prints the traceback instead")
NODE_LOSS = ("Multi-node jobs: CUDASNAP_NODE_REPLICA=1 (with CUDASNAP_HEALTH=1) also keeps "
             "each rank's newest snapshot in another node's memory, so a lost node resumes "
             "from there (CUDASNAP_NODE_REPLICA=xor:K: XOR parity over groups of K nodes, "
             "about 1/(K-1) of a copy); gc removes the copies and parity files whose holder "
             "is gone (README, 'Node loss').")


def _manifest_row(path: Path, verify: bool = False) -> dict[str, Any]:
    """One row; its data is "unverified" (manifest read only) unless ``verify``."""
    from ..format import paths
    from ..storage import posix

    try:
        m = posix.load_manifest(path / paths.MANIFEST)
        row = {"bytes": m["data"]["bytes"], "tensors": len(m["tensors"]),
               "rank": m.get("rank", 0), "world_size": m.get("world_size", 1),
               "created": m.get("created_unix"), "status": "unverified"}
    except Exception as e:  # noqa: BLE001 - reported per row
        return {"status": f"bad: {_clean(str(e))}"}
    if verify:
        try:
            ok, msg = _verify_one(path, _NoProgress())
        except Exception as e:  # noqa: BLE001 - reported per row
            ok, msg = False, _clean(str(e))
        row["status"] = "ok" if ok else f"FAILED: {msg}"
    return row


class _NoProgress:
    def update(self, n: int) -> None:
        pass


def _clean(msg: str) -> str:
    """An engine error for a user: without the internal check expression."""
    return re.sub(r" \[check: .*\]$", "", msg.strip())


def _snapshots_table(directory: Path, verify: bool = False) -> list[dict[str, Any]]:
    from ..storage import listing, posix
    from ..storage.latest import read_latest

    rows = []
    latest = read_latest(directory)
    for s in posix.list_snapshots(directory):
        ranks = sorted(p for p in s.path.glob("rank-*") if p.is_dir() and "." not in p.name)
        base = {"step": s.step, "source": "disk", "latest": s.path.name == latest}
        if not ranks:
            rows.append({**base, "path": str(s.path), "commit": "single",
                         **_manifest_row(s.path, verify)})
            continue
        commit = "committed" if listing.is_committed(s.path) else "NOT committed"
        for p in ranks:
            rows.append({**base, "path": str(p), "commit": commit, **_manifest_row(p, verify)})
    return rows


def cmd_inspect(a: argparse.Namespace) -> int:
    from .._native import native
    from ..format import paths

    if isinstance(a.directory, str):  # an fsspec URL (object store): no arena to list
        from ..storage.remote_report import inspect_url

        rows, job = inspect_url(a.directory, Settings.from_env(), a.verify), None
    elif not a.directory.is_dir():
        raise ConfigError(f"{a.directory} is not a directory" if a.directory.exists()
                          else f"no such directory: {a.directory}")
    else:
        rows = _snapshots_table(a.directory, a.verify)
        job = Settings.from_env().job or paths.job_for(a.directory, create=False)
    shm = Settings.from_env().shm_dir
    for path in sorted(shm.glob(paths.arena_glob(job))) if job else []:
        try:
            arena = native().Arena.open(str(path), False)
            for i in range(arena.num_slots):
                info = arena.slot_info(i)
                if info["state"] != "EMPTY":
                    rows.append({"step": info["step"], "path": f"{path}#slot{i}", "source": "shm",
                                 "bytes": info["data_bytes"], "status": "ok" if info["valid"]
                                 else f"{info['state']} {info['problem']}".strip(),
                                 "created": info["complete_ns"] / 1e9 or None})
        except Exception as e:  # noqa: BLE001
            rows.append({"path": str(path), "source": "shm", "status": f"bad: {e}"})
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no snapshots in {a.directory}")
        return 0
    print(f"{'step':>10}  {'source':6}  {'rank':>4}  {'MB':>10}  {'created':19}  {'commit':13}  "
          "status  path")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"])) \
            if r.get("created") else "-"
        mb = f"{r['bytes'] / 1e6:10.1f}" if r.get("bytes") is not None else f"{'-':>10}"
        star = " (latest)" if r.get("latest") else ""
        print(f"{r.get('step', '-'):>10}  {r['source']:6}  {r.get('rank', '-'):>4}  {mb}  "
              f"{created:19}  {r.get('commit', '-'):13}  {r['status']}{star}  {r['path']}")
    return 0


def _verify_one(step_dir: Path, progress: Any) -> tuple[bool, str]:
    """Checks one snapshot directory chunk by chunk; returns (ok, message)."""
    import mmap

    from .._native import native
    from ..format import paths
    from ..storage import posix

    m = posix.load_manifest(step_dir / paths.MANIFEST)
    d = m["data"]
    path = step_dir / d["file"]
    size = path.stat().st_size
    if size != d["bytes"]:
        return False, f"{path}: {size} bytes, the manifest says {d['bytes']} (truncated?)"
    chunk, crcs = int(d["chunk_bytes"]), [int(c) for c in d["crc32c"]]
    C = native()
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        try:
            for i, want in enumerate(crcs):
                piece = memoryview(mm)[i * chunk:min(size, (i + 1) * chunk)] if mm else b""
                got = C.crc32c(piece)
                if isinstance(piece, memoryview):
                    piece.release()
                progress.update(min(chunk, size - i * chunk))
                if got != want:
                    return False, (f"{path}: chunk {i} (bytes {i * chunk}..{min(size, (i + 1) * chunk)})"
                                   f" fails its CRC32C (stored {want:#010x}, read {got:#010x})")
        finally:
            if mm is not None:
                mm.close()
    dt = time.perf_counter() - t0
    return True, f"{size / 1e6:.1f} MB, {len(crcs)} chunks, {size / max(dt, 1e-9) / 1e9:.2f} GB/s"


def cmd_verify(a: argparse.Namespace) -> int:
    from ..storage import posix

    if isinstance(a.directory, str):  # an fsspec URL (object store)
        from ..storage.remote_report import verify_url

        rc, lines = verify_url(a.directory, Settings.from_env(), a.step)
        print("\n".join(lines), file=sys.stderr if rc == 2 else sys.stdout)
        return rc
    snaps = posix.list_snapshots(a.directory)
    if a.step is not None:
        snaps = [s for s in snaps if s.step == a.step]
        if not snaps:
            print(f"no snapshot of step {a.step} in {a.directory}", file=sys.stderr)
            return 2
    dirs: list[tuple[int, Path]] = []
    for s in snaps:
        subs = sorted(p for p in s.path.glob("rank-*") if p.is_dir() and ".tmp" not in p.name)
        dirs += [(s.step, p) for p in subs] if subs else [(s.step, s.path)]
    total = 0
    for _, p in dirs:
        try:
            total += (p / "data.bin").stat().st_size
        except OSError:
            pass
    bad = 0
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="verify",
              disable=not sys.stderr.isatty()) as bar:
        for step, p in dirs:
            try:
                ok, msg = _verify_one(p, bar)
            except Exception as e:  # noqa: BLE001 - every failure is reported
                ok, msg = False, str(e)
            bad += not ok
            print(f"step {step} {p.name if p.name.startswith('rank-') else ''}: "
                  f"{'ok' if ok else 'FAILED'} ({msg})".replace(" : ", ": "))
    if not dirs:  # nothing verified is not a success
        print(f"no snapshots in {a.directory}", file=sys.stderr)
        return 2
    return 1 if bad else 0


def cmd_export(a: argparse.Namespace) -> int:
    from ..format import paths
    from ..storage import posix
    from .export import (
        check_export_target,
        export_dcp,
        export_safetensors,
        export_torch,
        safetensors_paths,
    )

    if a.optimizer and a.fmt != "safetensors":
        raise ConfigError(f"--optimizer is for --to safetensors (a {a.fmt} export always "
                          "carries the optimizer state)")
    if a.merged and a.fmt != "safetensors":
        raise ConfigError(f"--merged is for --to safetensors of a PEFT snapshot (a {a.fmt} "
                          "export holds the wrapper's own names)")
    if a.fmt == "safetensors":
        from .export_peft import peft_record

        # A PEFT model's snapshot: an adapter folder or (--merged) a merged model, never
        # the wrapper's names (cudasnap.tools.export_peft); refuses PEFT-looking names
        # without the record.
        if peft_record(a.directory, a.step) is not None:
            return _export_peft(a)
        if a.merged:
            raise ConfigError("--merged is for a snapshot of a PEFT model (peft.PeftModel); "
                              f"{a.directory} holds none: export it without --merged")
    if a.fmt == "safetensors":  # sharded snapshots too: every rank's files, CRC-verified
        _, optim_file = safetensors_paths(a.directory, a.to_file, a.optimizer)
        print(f"wrote {export_safetensors(a.directory, a.to_file, a.step, a.optimizer)}")
        if optim_file is not None:
            print(f"wrote {optim_file}")
        return 0
    check_export_target(a.directory, a.to_file)
    if a.fmt == "dcp":
        print(f"wrote {export_dcp(a.directory, a.to_file, step=a.step)}")
        return 0
    snaps = [s for s in posix.list_snapshots(a.directory) if a.step is None or s.step == a.step]
    if snaps and (snaps[0].path / paths.MANIFEST).is_file():
        # the checksums first, for a message with the file, chunk and hex CRCs (a multi-rank
        # step's files are verified, rank by rank, as export_torch reads them)
        ok, msg = _verify_one(snaps[0].path, _NoProgress())
        if not ok:
            raise CorruptSnapshot(f"step {snaps[0].step} fails its checksum: {msg}")
    path = export_torch(a.directory, a.to_file, step=a.step)
    print(f"wrote {path}")
    return 0


def _export_peft(a: argparse.Namespace) -> int:
    from .export_peft import export_adapters, export_merged

    if a.optimizer:
        raise ConfigError("--optimizer is not supported for a PEFT snapshot's safetensors "
                          "export (its parameter order is the wrapper's); --to torch or --to "
                          "dcp carry the optimizer state")
    w = (export_merged if a.merged else export_adapters)(a.directory, a.to_file, a.step)
    for f in w.files:
        print(f"wrote {f}")
    for line in w.load:
        print(f"load: {line}")
    return 0


def cmd_gc(a: argparse.Namespace) -> int:
    """Removes every arena in the shared-memory directory whose holder is gone: own arenas
    (of any rank numbering), guest copies of node-loss replication (``-g<src>``) and the
    temporaries of a fetch or a regrown guest (hidden, the holder's pid in the name), and
    XOR parity files (``.xor``: their maker's pid in the trailer)."""
    from .._native import native
    from .._proc import pid_alive as _pid_alive
    from ..distributed.replica_store import hidden_holder
    from ..format import paths

    shm = Settings.from_env().shm_dir
    removed = 0
    hidden = [p for p in shm.glob(".cudasnap-*") if hidden_holder(p.name) is not None]
    from ..distributed.parity import read_trailer

    for path in sorted(shm.glob(paths.arena_glob())) + sorted(shm.glob("cudasnap-*.xor")) + sorted(hidden):
        try:
            if path.lstat().st_uid != os.getuid() and os.getuid() != 0:
                print(f"skip   {path} (owned by uid {path.lstat().st_uid})")
                continue
        except OSError:
            continue
        pid = hidden_holder(path.name)
        try:
            owner = pid if pid is not None else int(read_trailer(path).get("pid", -1)) \
                if path.suffix == ".xor" else native().Arena.open(str(path), False).owner_pid
        except Exception as e:  # noqa: BLE001
            owner = -1
            log.warning("unreadable arena %s: %s", path, e)
        if owner > 0 and _pid_alive(owner):
            print(f"keep   {path} (pid {owner} alive)")
            continue
        if a.dry_run:
            print(f"would remove {path} (owner {owner} gone)")
        else:
            path.unlink(missing_ok=True)
            print(f"removed {path} (owner {owner} gone)")
        removed += 1
    print(f"{removed} stale arena(s) {'found' if a.dry_run else 'removed'}")
    return 0


def cmd_health(a: argparse.Namespace) -> int:
    from ..triggers.nvml import read_gpu_status

    try:
        rows = read_gpu_status()
    except RuntimeError as e:
        print(str(e))
        return 0
    for r in rows:
        print(" ".join(f"{k}={v}" for k, v in r.items()))
    return 0


def cmd_advise(a: argparse.Namespace) -> int:
    from ..core.host_fit import host_fit, mem_available_bytes, pick_snapshot_every, shm_free_bytes
    from ..modelling.advice import advise, format_advice
    from ..modelling.restart import parse_parts

    for name in ("gpus", "mtbf_hours", "iter_seconds", "state_gb"):
        v = getattr(a, name)
        if not v > 0 or v != v or v == float("inf"):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, not {v}")

    d = advise(a.gpus, a.mtbf_hours, a.iter_seconds, a.state_gb, per_gpu=not a.job_mtbf,
               inprocess_parts=parse_parts(a.inprocess_parts) if a.inprocess_parts else None,
               inprocess_seconds=a.inprocess_seconds,
               **{k: v for k in ("spares_per_1k", "spare_refill_hours") if (v := getattr(a, k)) is not None})
    d["snapshot_every"] = pick_snapshot_every(a.state_gb, a.iter_seconds)
    d["host_memory"] = host_fit(a.state_gb, a.gpus_per_node or min(a.gpus, 8),
                                num_slots=a.num_slots, spare_slot=not a.no_spare_slot,
                                shm_free=shm_free_bytes(), mem_available=mem_available_bytes())
    print(json.dumps(d, default=str) if a.json else format_advice(d))
    return 0


def _directory_arg(text: str) -> Path | str:
    """A local directory (Path) or an fsspec URL kept as text (``s3://bucket/prefix``)."""
    from ..format.paths import is_url

    return text if is_url(text) else Path(text)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="cudasnap", description="just-in-time GPU checkpointing",
                                epilog=f"{EXIT_STATUS}. {NODE_LOSS}")
    p.add_argument("--debug", action="store_true", help="tracebacks for errors")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="train, inject a failure, resume bit for bit", add_help=False)
    sub.add_parser("run", help="supervise a training command (flush + restart)", add_help=False)
    q = sub.add_parser("inspect", help="list snapshots on disk and in shared memory")
    q.add_argument("directory", type=_directory_arg)
    q.add_argument("--json", action="store_true")
    q.add_argument("--verify", action="store_true",
                   help="check every checksum (status ok/FAILED instead of unverified)")
    q.set_defaults(fn=cmd_inspect)
    q = sub.add_parser("verify", help="check every checksum; non-zero exit on a mismatch")
    q.add_argument("directory", type=_directory_arg)
    q.add_argument("--step", type=int, default=None)
    q.set_defaults(fn=cmd_verify)
    q = sub.add_parser("export", help="write a snapshot as a torch state_dict file, a DCP "
                       "checkpoint (sharded: loads on any mesh) or consolidated safetensors")
    q.add_argument("directory", type=Path)
    q.add_argument("--to", dest="fmt", choices=["torch", "dcp", "safetensors"], default="torch")
    q.add_argument("to_file", type=Path, help="a file; for safetensors a directory (gets "
                   "model.safetensors, as from_pretrained reads it) or a .safetensors file; "
                   "for a PEFT model's snapshot a directory that gets the adapter folder "
                   "(adapter_model.safetensors + adapter_config.json, other adapters in "
                   "subfolders, as PeftModel.save_pretrained) or, with --merged, "
                   "model.safetensors + config.json")
    q.add_argument("--step", type=int, default=None)
    q.add_argument("--optimizer", action="store_true", help="safetensors: also write the "
                   "optimizer state to optimizer.safetensors beside the weights")
    q.add_argument("--merged", action="store_true", help="safetensors of a PEFT (LoRA) "
                   "snapshot: the base model with the active adapter(s) merged as "
                   "merge_and_unload() computes them, for <BaseModel>.from_pretrained(TO)")
    q.set_defaults(fn=cmd_export)
    q = sub.add_parser("gc", help="remove staging arenas of dead jobs from /dev/shm")
    q.add_argument("--dry-run", action="store_true")
    q.set_defaults(fn=cmd_gc)
    q = sub.add_parser("health", help="one line per GPU from NVML")
    q.set_defaults(fn=cmd_health)
    q = sub.add_parser("advise", help="periodic vs just-in-time checkpointing: expected waste")
    q.add_argument("--gpus", type=int, required=True)
    q.add_argument("--mtbf-hours", type=float, required=True, help="per-GPU MTBF (hours)")
    q.add_argument("--job-mtbf", action="store_true", help="--mtbf-hours is the job's MTBF")
    q.add_argument("--iter-seconds", type=float, required=True)
    q.add_argument("--state-gb", type=float, required=True, help="state per GPU (GB)")
    q.add_argument("--gpus-per-node", type=int, default=None, help="ranks per host (default min(gpus, 8))")
    q.add_argument("--num-slots", type=int, default=2)
    q.add_argument("--no-spare-slot", action="store_true")
    q.add_argument("--inprocess-parts", metavar="D,G,T,R", help="in-process restart as measured, "
                   "seconds: detect,regroup,spare take-over,restore (default: issue 46's, grown with N)")
    q.add_argument("--inprocess-seconds", type=float, help="in-process restart, a measured total")
    q.add_argument("--spares-per-1k", type=float, help="spare units per 1,024 GPUs (default 2)")
    q.add_argument("--spare-refill-hours", type=float, help="until a used spare is back (default 4)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(fn=cmd_advise)
    if argv[:1] == ["--debug"] and argv[1:2] == ["run"]:
        argv = ["run", "--debug", *argv[2:]]
    if argv[:1] == ["demo"]:
        from ..demo.runner import main as demo_main

        return demo_main(argv[1:])
    if argv[:1] == ["run"]:
        from ..supervisor.run import main as run_main

        return run_main(argv[1:])
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(a.fn(a))
    except (SnapshotError, OSError, ValueError) as e:  # one line, not a traceback
        if a.debug:
            raise
        print(f"cudasnap {a.cmd}: error: {_clean(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
