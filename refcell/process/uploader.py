"""The landing-zone uploader: closed logs and their captures go up, nothing else.

A log is uploaded only once it is closed (the MCAP footer ends in the magic bytes), to
`<landing>/<file name>`; the captures of its episodes go first, to `<landing>/captures/`, each
capture's sidecar last, so ingest finds an episode's captures when it reads the log.
`edge.channels.open_channel` does the writing: into a folder through a dot-file and a rename,
to S3 in one PUT (docs/operations.md, section 1). An uploaded file moves to `<box>/uploaded/`,
so what is left in a spool folder is exactly what still has to go; a failed upload is retried
at the next flush. Ground-truth side files (`.groundtruth/`) stay on the box.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from edge.channels import EdgeError, open_channel
from refcell.recorder import CAPTURES_DIR

MCAP_MAGIC = b"\x89MCAP0\r\n"
UNCLOSED_DIR = ".unclosed"

log = logging.getLogger("realloop.cell")


def is_closed(path: Path) -> bool:
    """A finished MCAP file ends with the magic bytes; one cut off mid-recording does not."""
    try:
        with path.open("rb") as stream:
            stream.seek(0, os.SEEK_END)
            if stream.tell() < 2 * len(MCAP_MAGIC):
                return False
            stream.seek(-len(MCAP_MAGIC), os.SEEK_END)
            return stream.read() == MCAP_MAGIC
    except OSError:
        return False


class LandingUploader:
    def __init__(self, landing_uri: str, sent_dir: Path, cell_id: str = "cell"):
        self.cell_id = cell_id  # for log lines only
        self.channel = open_channel(landing_uri)
        self.landing = landing_uri
        self.sent_dir = Path(sent_dir)
        self.uploaded: list[str] = []  # landing keys, this run
        self._last_error: str | None = None

    def flush(self, folder: Path, open_file: Path | None = None) -> bool:
        """Upload every closed log in `folder` but `open_file`, each after its captures.
        True when nothing is left to upload; on an error, log it and keep the rest for later."""
        for path in sorted(Path(folder).glob("*.mcap")):
            if path == open_file or not is_closed(path):
                continue
            try:
                captures = self._captures_of(Path(folder) / CAPTURES_DIR, path.name)
                for capture in captures:
                    self._send_capture(capture)
                self._send(path, path.name)
            except (EdgeError, OSError) as exc:
                self._warn_once(
                    f"upload of {path.name} to {self.landing} failed ({exc}); will retry"
                )
                return False
            size_mb = self._sent_path(path.name).stat().st_size / 1e6
            log.info(
                "%s: uploaded %s (%.2f MB, %d captures) to %s",
                self.cell_id,
                path.name,
                size_mb,
                len(captures),
                self.landing,
            )
            self._last_error = None
        return True

    def set_aside_unclosed(self, folder: Path) -> list[Path]:
        """Logs a killed cell left without a footer, and their captures, move to `.unclosed/`:
        never uploaded (ingest would quarantine them as truncated)."""
        moved = []
        for path in sorted(Path(folder).glob("*.mcap")):
            if is_closed(path):
                continue
            aside = Path(folder) / UNCLOSED_DIR
            aside.mkdir(exist_ok=True)
            for capture in self._captures_of(Path(folder) / CAPTURES_DIR, path.name):
                for part in capture:
                    os.replace(part, aside / part.name)
            os.replace(path, aside / path.name)
            log.warning(
                "%s: %s was still being recorded when the cell stopped (no MCAP footer): kept "
                "in %s, not uploaded",
                self.cell_id,
                path.name,
                aside,
            )
            moved.append(aside / path.name)
        return moved

    # --- internals -------------------------------------------------------------------
    def _captures_of(self, captures_dir: Path, log_name: str) -> list[list[Path]]:
        """Each capture of the log's episodes as its files in upload order, sidecar last."""
        captures = []
        for sidecar in sorted(captures_dir.glob("*.json")) if captures_dir.is_dir() else []:
            if sidecar.name.startswith("."):
                continue
            meta = json.loads(sidecar.read_text())  # written by this cell's recorder
            if meta.get("source_log") != log_name:
                continue
            names = [f"{sidecar.stem}.mcap", *meta.get("attachments", [])]
            parts = [captures_dir / name for name in names if (captures_dir / name).is_file()]
            captures.append([*parts, sidecar])
        return captures

    def _send_capture(self, files: list[Path]) -> None:
        for path in files:
            self._send(path, f"{CAPTURES_DIR}/{path.name}")

    def _send(self, path: Path, key: str) -> None:
        self.channel.put_file(key, path)
        sent = self._sent_path(key)
        sent.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, sent)
        self.uploaded.append(key)

    def _sent_path(self, key: str) -> Path:
        return self.sent_dir.joinpath(*key.split("/"))

    def _warn_once(self, message: str) -> None:
        if message != self._last_error:
            log.warning(message)
        self._last_error = message
