"""Errors the edge tools expect and report as one line, without a traceback."""

from __future__ import annotations


class EdgeError(Exception):
    """An expected failure; the message names the file or key, the reason and what to do."""


class KeyNotFoundError(EdgeError):
    """A key is absent on the channel (missing pointer, manifest or bundle file)."""


def describe_os_error(exc: OSError) -> str:
    """`<file>: <reason>` in one line, e.g. "/srv/model: Permission denied"."""
    where = exc.filename if exc.filename is not None else "file system"
    return f"{where}: {exc.strerror or exc}"


class NothingPublishedError(EdgeError):
    """The channel has no signed release for the cell yet: the box idles, nothing is wrong."""
