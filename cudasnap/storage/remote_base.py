"""The plain parts of an object-store directory: its filesystem, its local state directory,
one-line errors. Leaves of ``storage.fsspec``, importable without it.
"""
from __future__ import annotations

import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..config import Settings
from ..errors import ConfigError, SnapshotError
from ..format.paths import MANIFEST, url_hash
from .ownership import check_directory
from .safe_io import replace_private

if TYPE_CHECKING:
    import torch
    from fsspec import AbstractFileSystem

    from cudasnap._C import Arena

    from ..format.manifest import Manifest

UPLOAD_BLOCK = 16 << 20

#: protocols whose first path component is a bucket/container, never created here
_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


def _one_line(e: BaseException) -> str:
    """A backend error as one line: its type and first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


class _Unreachable:
    """``with _Unreachable(url, what):`` a backend error (connection refused, DNS, auth)
    becomes a SnapshotError of one line naming the URL; cudasnap errors pass."""

    def __init__(self, url: str, what: str) -> None:
        self.url, self.what = url, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: object) -> None:
        if e is None or isinstance(e, SnapshotError) or not isinstance(e, Exception):
            return
        raise SnapshotError(f"cannot {self.what} {self.url}: {_one_line(e)}") from e


#: in the state directory: the URL it stands for (for whoever looks at the directory)
URL_FILE = ".url"


def state_dir(url: str, base: Path | None) -> Path:
    """This host's local directory for a URL: lock, directory id (job), flush log, the
    index of committed multi-rank steps (``remote_ranks.sync_index``), ``cudasnap run``'s
    supervisor lock. ``base/url-<hash>`` (``base``: ``Settings.state_dir``,
    ``$CUDASNAP_STATE_DIR``), default under ``$XDG_CACHE_HOME/cudasnap`` (``~/.cache/cudasnap``)."""
    base = base or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cudasnap"
    d = check_directory(base / f"url-{url_hash(url)}")
    marker = d / URL_FILE
    text = url.rstrip("/") + "\n"
    try:
        if marker.read_text() == text:
            return d
    except OSError:
        pass
    replace_private(marker, text.encode())
    return d


def filesystem(url: str, endpoint: str | None) -> tuple[AbstractFileSystem, str]:
    """(fsspec filesystem, root path without protocol) of ``url``; ``endpoint``: an S3
    URL's (``Settings.s3_endpoint``, ``$CUDASNAP_S3_ENDPOINT``; None: AWS)."""
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise ConfigError(f"{url}: object-store directories need fsspec "
                          "(pip install 'cudasnap[s3]')") from e
    opts: dict[str, Any] = {}
    if url.startswith(("s3://", "s3a://")) and endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint}
    try:
        fs, root = fsspec.core.url_to_fs(url, **opts)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"cannot open snapshot URL {url}: {e}") from e
    return fs, str(root).rstrip("/")


@dataclass
class RemoteSnapshot:
    """A committed snapshot in an object store (``path``: its URL)."""

    step: int
    path: str

    @property
    def manifest_path(self) -> str:
        return f"{self.path}/{MANIFEST}"


class RemoteStore(Protocol):
    """What ``remote_ranks`` and ``remote_report`` use of ``fsspec.FsspecStorage`` (named
    here so that neither imports it: ``fsspec`` imports them)."""

    fs: AbstractFileSystem
    url: str
    protocol: str
    local_dir: Path
    settings: Settings

    def _key(self, *parts: str) -> str: ...
    def _url(self, key: str) -> str: ...
    def _step_dirs(self) -> dict[int, str]: ...
    def _cat(self, key: str, limit: int, what: str) -> bytes: ...
    def _committed_same(self, step_key: str, part: str, job: object, seq: int) -> bool: ...
    def _failing(self, what: str) -> AbstractContextManager[None]: ...
    def _upload_data(self, key: str, arena: Arena, slot: int, nbytes: int) -> None: ...
    def read_latest(self) -> str | None: ...
    def replace_latest(self, step: int, timeout: float | None = None) -> bool: ...
    def prune(self, keep: int) -> None: ...
    def list_snapshots(self) -> list[RemoteSnapshot]: ...
    def load_manifest(self, ref: Any, *, allow_foreign_owner: bool | None = None
                      ) -> Manifest: ...
    def read_data(self, ref: Any, manifest: Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None) -> torch.Tensor: ...
