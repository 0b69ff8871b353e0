"""The landing folder's layout: which of its files are shift logs, exports and capture sidecars.

The landing-folder source (sources.py) lists a folder with it, and the ingest loop (landing.py)
walks one with it, so both count the same files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

CAPTURES_DIR = "captures"
LOG_SUFFIX, JSONL_SUFFIX, PARQUET_SUFFIX = ".mcap", ".jsonl", ".parquet"


def landing_files(landing: Path, exclude: Iterable[Path] = ()) -> tuple[list[Path], list[Path]]:
    """(logs and exports, capture sidecars) under `landing`, sorted.

    Skips dot-folders and dotfiles, `*.partial` files (still being written) and the paths
    in `exclude`. MCAP files in `captures/` folders are capture windows, not shift logs.
    Symlinks are listed as they are (ingest_file refuses those that lead outside).
    """
    skip = {Path(p).absolute() for p in exclude} | {Path(p).resolve() for p in exclude}
    logs, sidecars = [], []
    for root, dirs, files in os.walk(landing):
        here = Path(root)
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and (here / d).absolute() not in skip
            and (here / d).resolve() not in skip
        )
        in_captures = here.name == CAPTURES_DIR
        for name in sorted(files):
            if name.startswith(".") or (here / name).absolute() in skip:
                continue
            if in_captures and name.endswith(".json"):
                sidecars.append(here / name)
            elif not in_captures and name.endswith((LOG_SUFFIX, JSONL_SUFFIX, PARQUET_SUFFIX)):
                logs.append(here / name)
    return logs, sidecars
