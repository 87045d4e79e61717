"""``objdir:///path``: a directory written as an object store (the object-store protocol of
``storage.fsspec`` over fsspec's local file system).

For a directory whose file system cannot be trusted with the POSIX commit: a bucket's FUSE
mount (mountpoint-s3, gcsfuse, s3fs), where a rename is a copy or is refused and an flock
is a no-op. Nothing is renamed: each object is written whole, the manifest after the data
and the COMMIT object last (a reader lists committed steps only); ``latest`` is a hint
replaced in place (a restore lists the steps, never trusts it); writers in progress are
marked by objects, not locks (``remote_ranks``). This host's lock, directory id and flush
log live in the URL's local state directory, as for any URL.

The root directory is made 0700 (``ownership.check_directory``) and every object written is
0600, as every file cudasnap writes (``_PrivateFiles``).

The backend is this module and its line in ``storage.registry.SCHEMES``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Settings
from ..errors import ConfigError
from .fsspec import FsspecStorage
from .ownership import check_directory

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


class ObjectDirStorage(FsspecStorage):
    """``storage.protocol.Storage`` of an ``objdir:///absolute/path`` URL."""

    def __init__(self, url: str, settings: Settings) -> None:
        path = url.split("://", 1)[1]
        if not path.startswith("/"):
            raise ConfigError(f"{url}: an objdir:// URL names an absolute path "
                              "(objdir:///mnt/bucket/run)")
        root = check_directory(Path(path))
        super().__init__(url, settings, fs=(_private_files(url), str(root).rstrip("/")))


def _private_files(url: str) -> AbstractFileSystem:
    """fsspec's local file system, every file it writes made 0600 as it is opened."""
    try:
        from fsspec.implementations.local import LocalFileSystem
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise ConfigError(f"{url}: objdir:// directories need fsspec "
                          "(pip install 'cudasnap[s3]')") from e

    class _PrivateFiles(LocalFileSystem):  # type: ignore[misc]
        def _open(self, path: str, mode: str = "rb", block_size: int | None = None,
                  **kw: object) -> object:
            f = super()._open(path, mode, block_size, **kw)
            if any(c in mode for c in "wxa"):
                os.chmod(self._strip_protocol(path), 0o600)
            return f

    return _PrivateFiles(auto_mkdir=True)


__all__ = ["ObjectDirStorage"]
