"""Fleet ingest on each engine: the flow's thread pool against a Dask cluster of 1 and 2 workers.

    .venv/bin/python -m bench.fleet_ingest [--cells 10] [--files-per-cell 50] [--episodes 2]
                                           [--repeats 1] [--json]

One process, one Prefect ephemeral API (started by a warm-up ingest before anything is
timed). One short shift is recorded once with the expert; every other log is a copy of it
from another cell and shift (cell id and shift id in the MCAP metadata and episode events
rewritten to the same length, every other message copied raw), so `cells` x `files_per_cell`
files are distinct sources from distinct cells at the cost of a copy.

Each engine gets a fresh workspace whose landing folder holds all the files, and
`ingest_flow` runs as `realloop ingest` runs it (list, one task per file, `dvc add`, git
commit and tag, `dvc push`), timed from the call to its return:
(a) the default: `ingest.cluster: null`, the flow's thread pool, `ingest.workers` at a time;
(b) `ingest.cluster: local:1`, a Dask LocalCluster of one single-threaded worker process;
(c) `ingest.cluster: local:2`, the same with two.
A LocalCluster is started inside the timed call (as a user's run starts it), so its start-up
is in the figure; so is versioning, the same for all three. With --repeats N each engine
runs N times (fresh workspaces) and the fastest run counts: this machine is shared.

Checked: every engine ingests every file, and the datasets are identical: the same content
hash (`dataset_content_hash`: every file of the dataset folder, with the two columns that
say which run wrote a row and when left out; those make each run's DVC version hash its own,
so the DVC versions are reported but differ by design) and the same DVC listing of sources.
Ratios are files/s against (a) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from bench.ingest_incremental import SHIFT_START, _record_base, _shift_id, rewrite_log

ENGINES = {"thread pool (default)": None, "dask 1 worker": "local:1", "dask 2 workers": "local:2"}
BASE_CELL = "cell-07"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_ingest", description=__doc__)
    parser.add_argument("--cells", type=int, default=10, help="cells in the fleet (at most 99)")
    parser.add_argument("--files-per-cell", type=int, default=50)
    parser.add_argument("--episodes", type=int, default=2, help="episodes per recorded log")
    parser.add_argument("--repeats", type=int, default=1, help="runs per engine; fastest counts")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    if not 1 <= args.cells <= 99 or args.files_per_cell < 1:
        print("bench.fleet_ingest: --cells must be 1..99, --files-per-cell >= 1", file=sys.stderr)
        return 1
    try:
        report = run(
            args.cells, args.files_per_cell, args.episodes, args.repeats, args.params.resolve()
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench.fleet_ingest: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0 if report["identical"] else 1


def run(cells: int, per_cell: int, episodes: int, repeats: int, params_path: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-fleet-ingest-") as tmp:
        tmp = Path(tmp)
        from flows.prefect_env import configure_prefect

        configure_prefect(tmp / "prefect")
        base = _record_base(tmp / "recorded", episodes, params_path)
        started = time.perf_counter()
        logs = [
            _variant(base, tmp / "logs", f"cell-{cell:02d}", index)
            for cell in range(1, cells + 1)
            for index in range(per_cell)
        ]
        variants_s = time.perf_counter() - started
        _ingest(tmp / "warm-up", params_path, logs[:1], None)  # starts the API, untimed
        runs: dict[str, list[dict]] = {name: [] for name in ENGINES}
        for attempt in range(repeats):
            for name, cluster in ENGINES.items():
                root = tmp / f"{name.split()[0]}-{cluster or 'pool'}-{attempt}"
                runs[name].append(_ingest(root, params_path, logs, cluster))
        best = {name: min(r, key=lambda x: x["seconds"]) for name, r in runs.items()}
        log_bytes = base.stat().st_size
    baseline = best["thread pool (default)"]["files_per_s"]
    for row in best.values():
        row["ratio_to_default"] = row["files_per_s"] / baseline
    hashes = {row["content_hash"] for row in best.values()}
    listings = {row["sources_hash"] for row in best.values()}
    return {
        "cells": cells,
        "files_per_cell": per_cell,
        "files": len(logs),
        "episodes_per_log": episodes,
        "log_bytes": log_bytes,
        "variants_s": variants_s,
        "repeats": repeats,
        "engines": best,
        "identical": len(hashes) == 1 and len(listings) == 1,
        "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0]},
    }


def _ingest(root: Path, params_path: Path, logs: list[Path], cluster: str | None) -> dict:
    """A fresh workspace holding `logs` in its landing folder; `ingest_flow` on it, timed."""
    import hashlib

    import yaml

    from flows.ingest import ingest_flow
    from pipelines.ingest import versioning
    from pipelines.ingest.store import dataset_content_hash

    landing = root / "data" / "landing"
    landing.mkdir(parents=True)
    params = yaml.safe_load(params_path.read_text())
    params["ingest"]["cluster"] = cluster
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    for log in logs:
        os.link(log, landing / log.name)  # the same bytes, no copy
    started = time.perf_counter()
    result = ingest_flow(str(root / "params.yaml"), str(root))
    seconds = time.perf_counter() - started
    report = result["ingest"]
    if report["files_ingested"] != len(logs):
        raise ValueError(
            f"{cluster or 'thread pool'}: ingested {report['files_ingested']} of {len(logs)} "
            f"({report['files_quarantined']} quarantined)"
        )
    dataset = root / "data" / "dataset"
    sources = versioning.version_sources(root, result["dataset_version"])
    return {
        "cluster": cluster,
        "seconds": seconds,
        "files_per_s": len(logs) / seconds,
        "episodes": report["episodes_ingested"],
        "dvc_version": result["dataset_version"],
        "content_hash": dataset_content_hash(dataset),
        "sources_hash": hashlib.sha256("\n".join(sources).encode()).hexdigest(),
    }


def _variant(base: Path, folder: Path, cell: str, index: int) -> Path:
    """`base` as if recorded by `cell` in another shift: the cell id and shift id replaced
    (same lengths) in the metadata, the episode events and the name; every other message
    copied byte for byte."""
    old_shift = _shift_id(SHIFT_START)
    new_shift = _shift_id(SHIFT_START + timedelta(minutes=10 * (index + 1)))
    swaps = ((old_shift, new_shift), (BASE_CELL, cell))

    def swap(text: str) -> str:
        for old, new in swaps:
            text = text.replace(old, new)
        return text

    folder.mkdir(parents=True, exist_ok=True)
    out = folder / swap(base.name)
    rewrite_log(base, out, swap)
    return out


def _format(report: dict) -> str:
    lines = [
        f"fleet ingest: {report['cells']} cells x {report['files_per_cell']} files = "
        f"{report['files']} logs of {report['log_bytes']} bytes, "
        f"{report['episodes_per_log']} episodes each ({report['machine']['cores']} cores; "
        f"fastest of {report['repeats']})",
    ]
    for name, row in report["engines"].items():
        lines.append(
            f"  {name:<22} {row['seconds']:7.1f} s  {row['files_per_s']:6.1f} files/s  "
            f"x{row['ratio_to_default']:.2f}  content {row['content_hash'][:16]}  "
            f"dvc {row['dvc_version'][:12]}"
        )
    verdict = "identical" if report["identical"] else "DIFFERENT"
    lines.append(f"  datasets: {verdict} (content hash without run columns, and sources listed)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
