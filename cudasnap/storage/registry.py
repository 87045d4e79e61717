"""Storage backends by URL scheme: the one place a directory's text picks its backend.

Each scheme names a class satisfying ``storage.protocol.Storage``, as ``module:Class``; the
module is imported only when a directory of its scheme is opened (a local path never
imports fsspec). A class is made from the directory's text with its ``open`` classmethod,
which checks what can be checked before anything is written (the bucket exists, the
prefix or directory is writable) and raises ``ConfigError`` otherwise.

A new backend is one module (its class and its tests) and one line in ``SCHEMES``: the
``objdir://`` line is one (``storage.object_dir``). A URL whose scheme has no line goes to
``FsspecStorage`` (``s3://``, ``gs://``, ``memory://``: any fsspec URL).
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, cast

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import Settings
    from .protocol import Storage

SCHEMES: dict[str, str] = {
    "": "cudasnap.storage.posix:PosixStorage",  # a local path
    "objdir": "cudasnap.storage.object_dir:ObjectDirStorage",  # a directory, written as objects
    "*": "cudasnap.storage.fsspec:FsspecStorage",  # any other URL: fsspec's
}


def scheme_of(directory: str | os.PathLike[str]) -> str:
    """The URL scheme of ``directory`` ("" for a local path; ``file://`` is a local path
    too, as ``format.paths.is_url`` says)."""
    text = os.fspath(directory)
    if "://" not in text or text.startswith("file://"):
        return ""
    return text.split("://", 1)[0].lower()


def backend_of(directory: str | os.PathLike[str]) -> type[Storage]:
    """The backend class that stores ``directory``."""
    target = SCHEMES.get(scheme_of(directory)) or SCHEMES["*"]
    module, _, name = target.partition(":")
    try:
        return cast("type[Storage]", getattr(importlib.import_module(module), name))
    except ImportError as e:
        raise ConfigError(f"{os.fspath(directory)}: its storage backend {target} cannot be "
                          f"imported: {e}") from e


def url_of(directory: str | os.PathLike[str] | Storage) -> str | os.PathLike[str]:
    """What ``directory`` names: itself, or a ``Storage``'s ``url``."""
    return directory if isinstance(directory, (str, os.PathLike)) else directory.url


def open_storage(directory: str | os.PathLike[str] | Storage, settings: Settings) -> Storage:
    """The storage of ``directory`` (a local path or a URL), opened and checked with the
    entry point's ``settings``; a ``Storage`` passed in is returned as it is (made and
    checked by its caller)."""
    if not isinstance(directory, (str, os.PathLike)):
        return directory
    return backend_of(directory).open(os.fspath(directory), settings)


__all__ = ["SCHEMES", "backend_of", "open_storage", "scheme_of", "url_of"]
