"""``objdir:///path``: a directory written as an object store (the object-store protocol of
``storage.fsspec`` over fsspec's local file system).

For a directory whose file system cannot be trusted with the POSIX commit: a bucket's FUSE
mount (mountpoint-s3, gcsfuse, s3fs), where a rename is a copy or is refused and an flock
is a no-op. Nothing is renamed: each object is written whole, the manifest after the data
and the COMMIT object last (a reader lists committed steps only); ``latest`` is a hint
replaced in place (a restore lists the steps, never trusts it); writers in progress are
marked by objects, not locks (``remote_ranks``). This host's lock, directory id and flush
log live in the URL's local state directory, as for any URL.

The root directory is made 0700 (``ownership.check_directory``): the objects below it are
written with the process's umask, and no other user can reach them.

The backend is this module and its line in ``storage.registry.SCHEMES``.
"""
from __future__ import annotations

from pathlib import Path

from ..config import Settings
from ..errors import ConfigError
from .fsspec import FsspecStorage
from .ownership import check_directory


class ObjectDirStorage(FsspecStorage):
    """``storage.protocol.Storage`` of an ``objdir:///absolute/path`` URL."""

    def __init__(self, url: str, settings: Settings) -> None:
        path = url.split("://", 1)[1]
        if not path.startswith("/"):
            raise ConfigError(f"{url}: an objdir:// URL names an absolute path "
                              "(objdir:///mnt/bucket/run)")
        try:
            from fsspec.implementations.local import LocalFileSystem
        except ImportError as e:  # pragma: no cover - the extra is missing
            raise ConfigError(f"{url}: objdir:// directories need fsspec "
                              "(pip install 'cudasnap[s3]')") from e
        root = check_directory(Path(path))
        super().__init__(url, settings, fs=(LocalFileSystem(auto_mkdir=True), str(root).rstrip("/")))


__all__ = ["ObjectDirStorage"]
