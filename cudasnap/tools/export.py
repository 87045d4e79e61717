"""Export a cudasnap snapshot to formats a script's own resume path can load."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError, SnapshotError
from ..format import codec, paths
from ..format.manifest import torch_dtype
from ..storage import posix


def load_tensors(directory: Path, step: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns ({tensor name: tensor}, manifest) of a verified snapshot."""
    snaps = posix.list_snapshots(Path(directory))
    if step is not None:
        snaps = [s for s in snaps if s.step == step]
    if not snaps:
        raise SnapshotError(f"no snapshot{f' of step {step}' if step is not None else ''} "
                            f"in {directory}")
    s = snaps[0]
    m = posix.load_manifest(s.manifest_path)
    data = posix.read_data(s.path, m)
    out = {}
    for e in m["tensors"]:
        dt = torch_dtype(e["dtype"])
        n = e["nbytes"]
        t = data[e["offset"]:e["offset"] + n].view(dt).as_strided(e["shape"], e["stride"]) \
            if n else data[:0].view(dt).reshape(e["shape"])
        out[e["name"]] = t.clone()
    return out, m


def check_export_target(directory: Path, to_file: Path) -> None:
    """Refuses an export target that is one of the snapshot directory's own files.

    (``cudasnap export D --to torch D/latest`` overwrote the ``latest`` pointer.)
    """
    d = Path(directory).resolve()
    t = Path(to_file).resolve()
    if t == d or t.is_dir():
        raise ConfigError(f"export target {to_file} is a directory; give a file name")
    if t.parent == d and (t.name == paths.LATEST or t.name.startswith(".")
                          or t.name.startswith("step-")) or d in t.parents and any(
            p.name.startswith("step-") for p in t.relative_to(d).parents if p != Path(".")):
        raise ConfigError(f"export target {to_file} is inside the snapshot directory's own "
                          f"files (it would overwrite {t.relative_to(d)}); write it elsewhere")


def export_torch(directory: Path, to_file: Path, step: int | None = None) -> Path:
    """Writes ``{"model": state_dict, "optimizer": {...}, "step": N, "extra": {...}}`` with torch.save.

    Model keys drop the ``model.`` prefix so ``model.load_state_dict(d["model"])``
    works; optimizer entries follow ``Optimizer.state_dict()`` (state keyed by
    parameter index, param_groups). The export is a torch (pickle) file by
    design: it is for the user's own loader; cudasnap's own format never pickles.
    """
    import torch

    check_export_target(directory, to_file)
    tensors, m = load_tensors(directory, step)
    host = codec.decode(m["host"], "host")
    models: dict[str, dict[str, Any]] = {}
    optims: dict[str, dict[str, Any]] = {}
    for e in m["tensors"]:
        group = e.get("group", "")
        kind, _, key = group.partition(":")
        if kind == "model":
            sd = models.setdefault(key, {})
            sd[e["name"][len(key) + 1:]] = tensors[e["name"]]
            for alias in e.get("aliases", []):
                sd[alias[len(key) + 1:]] = tensors[e["name"]]
        elif kind == "optim":
            st = optims.setdefault(key, {"state": {}, "param_groups": []})["state"]
            st.setdefault(e["param_index"], {})[e["state_key"]] = tensors[e["name"]]
    for key, h in host.get("optim", {}).items():
        o = optims.setdefault(key, {"state": {}, "param_groups": []})
        from ..core.state import _expand_params

        o["param_groups"] = [_expand_params(g) for g in h["param_groups"]]
        for idx, k, v in h.get("scalars", []):
            o["state"].setdefault(int(idx), {})[k] = v
    out = {"step": m["step"], "model": models.get("model", models),
           "optimizer": optims.get("optim", optims),
           "extra": {k: v.get("state") for k, v in host.get("extra", {}).items()},
           "cudasnap_manifest": json.loads(json.dumps({k: m[k] for k in ("step", "format_version")}))}
    to_file = Path(to_file)
    torch.save(out, to_file)
    return to_file
