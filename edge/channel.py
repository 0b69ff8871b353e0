"""The channel: flat key → bytes storage between the publisher and the edge boxes.

`Channel` is what both sides rely on (atomic writes, sorted listings, KeyNotFoundError for a
missing key); `LocalChannel` is one on a local or mounted file system (a path or a file://
URI), and `edge.s3.S3Channel` one on an S3 prefix. `edge.channels` opens one from its URI and
publishes bundles to it.
"""

from __future__ import annotations

import builtins
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from edge.errors import EdgeError, KeyNotFoundError

__all__ = ["Channel", "LocalChannel", "check_key"]


class Channel(ABC):
    """Flat key → bytes storage. Keys are relative, '/'-separated, e.g. "tuf/timestamp.json"."""

    uri: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` at `key` in one atomic write: readers see the old or the new object."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Like put_bytes, streaming from a local file."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The object at `key`; KeyNotFoundError when absent."""

    @abstractmethod
    def get_file(self, key: str, dest: Path) -> None:
        """Stream the object at `key` into the local file `dest`; KeyNotFoundError when absent."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object at `key`; no error when it is already gone."""

    @abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]:
        """Sorted keys that start with `prefix`."""

    @abstractmethod
    def sweep_partials(self, older_than_s: float) -> builtins.list[str]:
        """Remove what interrupted writes left (`*.partial`) and nobody touched for
        `older_than_s`; return the keys removed. Younger ones may be writes in flight."""

    def describe(self, key: str) -> str:
        """Where a key lives, for messages an operator can act on."""
        return f"{self.uri.rstrip('/')}/{key}"


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(part in ("", ".", "..") for part in parts):
        raise EdgeError(f"channel key {key!r}: must be a relative path without '.' or '..'")
    return key


class LocalChannel(Channel):
    """A channel on a local or mounted file system; writes are atomic via os.replace."""

    _PARTIAL = ".partial"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.uri = str(self.root)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write_atomically(key, lambda out: out.write(data))

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as source:
            self._write_atomically(key, lambda out: shutil.copyfileobj(source, out))

    def get_bytes(self, key: str) -> bytes:
        with self._reading(key) as path:
            return path.read_bytes()

    def get_file(self, key: str, dest: Path) -> None:
        with self._reading(key) as path:
            shutil.copyfile(path, dest)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> builtins.list[str]:
        # Walk only the deepest directory the prefix names, not the whole channel.
        start = self.root.joinpath(*prefix.split("/")[:-1])
        keys = [
            path.relative_to(self.root).as_posix()
            for path in start.rglob("*")
            if path.is_file() and not path.name.endswith(self._PARTIAL)
        ]
        return sorted(key for key in keys if key.startswith(prefix))

    def sweep_partials(self, older_than_s: float) -> builtins.list[str]:
        # Temp files of killed writes (ours: `.<name>.<random>.partial`), and staging folders
        # named so (a trial request's files), anywhere below the root.
        cutoff = time.time() - older_than_s
        swept = []
        for path in sorted(self.root.rglob(f"*{self._PARTIAL}")) if self.root.is_dir() else []:
            try:
                if path.lstat().st_mtime >= cutoff:
                    continue
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            except FileNotFoundError:
                continue  # another sweep got there first
            swept.append(path.relative_to(self.root).as_posix())
        return swept

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    @contextmanager
    def _reading(self, key: str) -> Iterator[Path]:
        try:
            yield self._path(key)
        except FileNotFoundError:
            raise KeyNotFoundError(f"{self.describe(key)}: not found") from None
        except OSError as exc:
            raise EdgeError(f"{self.describe(key)}: cannot read ({exc.strerror})") from None

    def _write_atomically(self, key: str, write: Callable[[IO[bytes]], Any]) -> None:
        # The temp file lives in the target's directory so os.replace never crosses a file system.
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=self._PARTIAL, dir=target.parent
        )
        try:
            with os.fdopen(fd, "wb") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, target)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
