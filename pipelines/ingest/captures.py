"""Edge-case captures: a JSON sidecar in a `captures/` folder names an episode, why it is an
edge case, and its attachment files (snapshots). Ingest marks those episodes and stores the
attachments content-addressed in the dataset; an unreadable sidecar is quarantined."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from pipelines.ingest.decoded import ContractViolation
from pipelines.ingest.landing_layout import CAPTURES_DIR
from pipelines.ingest.quarantine import quarantine_file
from pipelines.ingest.report import QUARANTINED, FileResult
from pipelines.ingest.store import _write_atomically, record_in_manifest, sha256_file


@dataclass(frozen=True)
class Capture:
    """An edge-case capture's sidecar: which episode, why, and its attachment files."""

    episode_id: str
    reason: str
    log_time_ns: int
    attachments: tuple[Path, ...]
    sidecar: Path


def read_capture(sidecar: Path) -> Capture:
    """Parse a capture's JSON sidecar; raise ContractViolation with a one-line reason."""
    try:
        meta = json.loads(sidecar.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ContractViolation(f"capture sidecar is not readable JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ContractViolation("capture sidecar is not a JSON object")
    episode_id, reason = meta.get("episode_id"), meta.get("reason")
    names = meta.get("attachments", [])
    if not isinstance(episode_id, str) or not isinstance(reason, str):
        raise ContractViolation("capture sidecar lacks episode_id or reason")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ContractViolation("capture sidecar attachments is not a list of file names")
    files = []
    for name in names:
        if Path(name).name != name or name in ("", ".", ".."):
            raise ContractViolation(f"capture attachment {name!r} is not a plain file name")
        path = sidecar.parent / name
        if not path.is_file():
            raise ContractViolation(f"capture attachment {name} is missing")
        if not path.resolve().is_relative_to(sidecar.parent.resolve()):
            raise ContractViolation(f"capture attachment {name} escapes the captures folder")
        files.append(path)
    log_time = meta.get("log_time_ns")
    return Capture(
        episode_id, reason, log_time if isinstance(log_time, int) else 0, tuple(files), sidecar
    )


def mark_edge_cases(
    episodes: pa.Table, captures: Mapping[str, list[Capture]]
) -> tuple[pa.Table, dict[str, list[Path]]]:
    """Fill edge_case, edge_case_reasons and attachments (sha256s); return the table and
    each episode's attachment files to store. Episodes without captures keep edge_case
    false and null lists."""
    flags, reasons, shas, files = [], [], [], {}
    for episode_id in episodes.column("episode_id").to_pylist():
        found = sorted(captures.get(episode_id, []), key=lambda c: (c.log_time_ns, c.reason))
        flags.append(bool(found))
        reasons.append(list(dict.fromkeys(c.reason for c in found)) if found else None)
        paths = [p for c in found for p in c.attachments]
        if paths:
            files[episode_id] = paths
        shas.append(list(dict.fromkeys(sha256_file(p) for p in paths)) if found else None)
    for name, values in (
        ("edge_case", flags),
        ("edge_case_reasons", reasons),
        ("attachments", shas),
    ):
        index = episodes.schema.get_field_index(name)
        episodes = episodes.set_column(
            index, episodes.schema.field(index), pa.array(values, episodes.schema.field(index).type)
        )
    return episodes, files


def with_edge_cases(
    episodes: pa.Table, captures: Mapping[str, list[Capture]], attachments_dir: Path
) -> pa.Table:
    """`mark_edge_cases`, storing the attachment files at once."""
    episodes, files = mark_edge_cases(episodes, captures)
    for paths in files.values():
        for path in paths:
            store_attachment(path, attachments_dir)
    return episodes


def store_attachment(path: Path, attachments_dir: Path, tmp_dir: Path | None = None) -> str:
    """Copy `path` to `<attachments_dir>/<sha256>.<ext>` unless that content is stored."""
    sha = sha256_file(path)
    ext = path.suffix.lower().lstrip(".") or "bin"
    dest = attachments_dir / f"{sha}.{ext}"
    if not dest.exists():

        def copy(stream) -> None:
            with path.open("rb") as source:
                shutil.copyfileobj(source, stream)

        _write_atomically(dest, copy, tmp_dir=tmp_dir)
    return sha


def read_captures(
    sidecars: Iterable[Path], quarantine: Path, run_id: str
) -> tuple[dict[str, list[Capture]], list[FileResult]]:
    """Captures by episode id, and a quarantine result for each sidecar that cannot be read."""
    captures: dict[str, list[Capture]] = {}
    results = []
    for sidecar in sidecars:
        try:
            capture = read_capture(sidecar)
        except ContractViolation as exc:
            try:
                entry = quarantine_file(sidecar, f"capture: {exc}", quarantine, run_id)
            except FileNotFoundError:
                continue  # another run quarantined it
            results.append(
                FileResult(
                    entry["source"],
                    entry["sha256"],
                    entry["size"],
                    QUARANTINED,
                    entry["reason"],
                    0,
                    0,
                    entry["moved_to"],
                )
            )
            continue
        captures.setdefault(capture.episode_id, []).append(capture)
    return captures, results


def ingest_captures(
    sidecars: Iterable[Path], dataset: Path, quarantine: Path, run_id: str
) -> tuple[dict[str, list[Capture]], list[FileResult]]:
    """`read_captures`, with a manifest line for each sidecar it quarantines. A flow calls it
    once per run and passes the captures to each `ingest_file`."""
    captures, rejected = read_captures(sidecars, quarantine, run_id)
    for result in rejected:
        record_in_manifest(dataset, result, run_id)
    return captures, rejected


def _captures_near(path: Path, landing: Path, episode_ids: Iterable[str]) -> dict:
    """The readable captures of these episodes in `<landing>/captures/` and in the
    `captures/` folder next to the file (unreadable sidecars are ingest_landing's to
    quarantine)."""
    wanted = set(episode_ids)
    folders = dict.fromkeys([Path(landing) / CAPTURES_DIR, Path(path).parent / CAPTURES_DIR])
    captures: dict[str, list[Capture]] = {}
    for folder in folders:
        if not folder.is_dir():
            continue
        for sidecar in sorted(folder.glob("*.json")):
            if sidecar.name.startswith(".") or not any(
                sidecar.name.startswith(f"{e}_") for e in wanted
            ):
                continue
            try:
                capture = read_capture(sidecar)
            except ContractViolation:
                continue
            if capture.episode_id in wanted:
                captures.setdefault(capture.episode_id, []).append(capture)
    return captures
