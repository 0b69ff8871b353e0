"""The box's side of the signed channel: enrolment and `tuf.ngclient.Updater` over a Channel.

```
BOX/tuf/enrollment.json     {"channel": URI, "cell_id": ID}: written once by `init`
BOX/tuf/metadata/           the trusted metadata (root.json from enrolment, then ngclient's)
```
The Updater does the TUF client workflow: root rotations, then timestamp, snapshot, targets and
the cell's delegated role, refusing rollback (versions only go up against what this box has
seen), freeze (expired metadata), mix-and-match (the snapshot pins every role's version, the
timestamp the snapshot's hash), wrong keys and any target not listed with its hash.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tuf.api import exceptions as tuf_errors
from tuf.api.metadata import Metadata, Root, TargetFile
from tuf.api.serialization import DeserializationError
from tuf.ngclient import Updater, UpdaterConfig
from tuf.ngclient.fetcher import FetcherInterface

from edge.bundle import check_name, parse_json
from edge.channel import Channel
from edge.channels import open_channel
from edge.errors import EdgeError, KeyNotFoundError, NothingPublishedError
from edge.tuf_repo import METADATA_PREFIX, TARGETS_PREFIX

TUF_DIR = "tuf"
ENROLLMENT_FILE = "enrollment.json"
_URL = "channel:///"


class ChannelFetcher(FetcherInterface):
    """Serves ngclient's downloads from our Channel (folder or S3): a missing key is a 404."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.last_key: str | None = None  # what a refusal was about, for its message

    def _fetch(self, url: str) -> Iterator[bytes]:
        key = url.removeprefix(_URL)
        self.last_key = key
        try:
            data = self.channel.get_bytes(key)
        except KeyNotFoundError as exc:
            raise tuf_errors.DownloadHTTPError(str(exc), 404) from None
        except EdgeError as exc:  # unreachable, denied, an unsafe key ('..')
            raise tuf_errors.DownloadError(str(exc)) from None
        yield data


def enroll(channel_uri: str, cell_id: str, box: Path, root_path: Path) -> dict[str, Any]:
    """Trust `root_path` (the channel's root metadata, from its publisher) for `cell_id`."""
    check_name(cell_id, "cell id")
    try:
        data = Path(root_path).read_bytes()
        root = Metadata[Root].from_bytes(data)
    except OSError as exc:
        raise EdgeError(f"{root_path}: cannot read the root metadata ({exc.strerror})") from None
    except DeserializationError as exc:
        raise EdgeError(f"{root_path}: not TUF root metadata ({exc})") from None
    folder = Path(box) / TUF_DIR
    if (folder / ENROLLMENT_FILE).exists():
        raise EdgeError(f"{box}: already enrolled; enrol a box once (a new box folder to redo)")
    (folder / "metadata").mkdir(parents=True, exist_ok=True)
    (folder / "metadata" / "root.json").write_bytes(data)
    enrollment = {"channel": str(channel_uri), "cell_id": cell_id}
    _write_json(folder / ENROLLMENT_FILE, enrollment)
    return {**enrollment, "box": str(box), "root_version": root.signed.version}


def enrollment(box: Path) -> dict[str, str]:
    path = Path(box) / TUF_DIR / ENROLLMENT_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise EdgeError(
            f"{box}: not enrolled; run `realloop-edge init --channel URI --cell ID --box {box} "
            "--root root.json` once"
        ) from None
    document = parse_json(data, str(path))
    if not isinstance(document, dict) or "channel" not in document or "cell_id" not in document:
        raise EdgeError(f"{path}: not an enrolment record; enrol the box again in a new folder")
    return document


class SignedChannel:
    """One update session: fresh metadata, then verified targets of the enrolled cell."""

    def __init__(self, box: Path) -> None:
        self.box = Path(box)
        record = enrollment(self.box)
        self.cell_id: str = record["cell_id"]
        self.channel_uri: str = record["channel"]
        self._fetcher = ChannelFetcher(open_channel(self.channel_uri))
        self._updater = Updater(
            metadata_dir=str(self.box / TUF_DIR / "metadata"),
            metadata_base_url=_URL + METADATA_PREFIX,
            target_base_url=_URL + TARGETS_PREFIX,
            fetcher=self._fetcher,
            config=UpdaterConfig(max_root_rotations=64),
            bootstrap=None,  # the root stored at enrolment is the trust anchor
        )

    def refresh(self) -> None:
        try:
            with translated("channel metadata", self._fetcher):
                self._updater.refresh()
        except EdgeError as exc:
            if "timestamp.json: not found" in str(exc):
                raise NothingPublishedError(
                    f"{self.channel_uri}: no signed releases yet (no timestamp.json)"
                ) from None
            raise

    def info(self, path: str) -> TargetFile | None:
        with translated(path, self._fetcher):
            return self._updater.get_targetinfo(path)

    def download(self, info: TargetFile, dest: Path) -> Path:
        with translated(info.path, self._fetcher):
            return Path(self._updater.download_target(info, str(dest)))

    def fetch_bytes(self, path: str, dest: Path) -> bytes:
        """The verified bytes of target `path`, saved at `dest`; EdgeError when unlisted."""
        info = self.info(path)
        if info is None:
            raise EdgeError(f"target {path}: not listed in the signed metadata; refusing it")
        return self.download(info, dest).read_bytes()


class translated:
    """ngclient's errors as one-line EdgeErrors saying what was refused and why."""

    def __init__(self, what: str, fetcher: ChannelFetcher) -> None:
        self.what, self.fetcher = what, fetcher

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(
            exc, tuf_errors.RepositoryError | tuf_errors.DownloadError
        ):
            return False
        reason = _REASONS.get(type(exc))
        cause = exc.__cause__ if isinstance(exc, tuf_errors.DownloadError) else None
        detail = " ".join(str(cause or exc).split())
        label = f"{reason}: " if reason else ""
        where = f" (reading {self.fetcher.last_key})" if self.fetcher.last_key else ""
        raise EdgeError(f"{self.what}{where}: {label}{detail}; refusing it") from None


_REASONS: dict[type, str] = {
    tuf_errors.BadVersionNumberError: "rollback attack (version went down)",
    tuf_errors.ExpiredMetadataError: "freeze attack (metadata expired)",
    tuf_errors.UnsignedMetadataError: "bad signature (not signed by the trusted keys)",
    tuf_errors.LengthOrHashMismatchError: "hash mismatch (tampered or mixed)",
    tuf_errors.DownloadLengthMismatchError: "length mismatch (tampered)",
}


def _write_json(path: Path, document: dict[str, Any]) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temp, path)
