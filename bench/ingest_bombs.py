"""What a hostile MCAP file costs ingest's decoder, against an honest log, in one run.

    .venv/bin/python -m bench.ingest_bombs [--json]

Each file is decoded the way ingest decodes a landed log (`shift_log.read_log`, default
`DecodeLimits`) in its own fresh process, which reports its peak RSS and the wall time of
the decode. The baseline is a real shift log recorded by the reference cell (the expert,
20 episodes); the bombs are bench.mcap_bombs': a zstd chunk of zeros declaring 1 GiB, one
of 60 MiB (under the chunk limit, over the ratio), a chunk of 600,000 empty records and a
file of 12,000 empty chunks. Figures are ratios to the baseline: a refused bomb should cost
about what reading an honest log costs, whatever it declares.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from bench import mcap_bombs

CHILD = """
import json, sys, time
from pathlib import Path
from pipelines.ingest.shift_log import read_log
start = time.perf_counter()
try:
    read_log(Path(sys.argv[1]))
    outcome = "decoded"
except Exception as exc:
    outcome = str(exc)
seconds = time.perf_counter() - start
# VmHWM, not ru_maxrss: Linux carries the parent's peak over fork and exec into ru_maxrss.
status = Path("/proc/self/status").read_text().splitlines()
peak = int(next(line for line in status if line.startswith("VmHWM:")).split()[1])
print(json.dumps({"outcome": outcome, "seconds": seconds, "peak_rss_mb": peak / 1024}))
"""


def measure(path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, check=True
    )
    return {"bytes": path.stat().st_size, **json.loads(done.stdout)}


def files(folder: Path) -> dict[str, Path]:
    from pipelines.contract.params import load_params
    from refcell.expert import Expert
    from refcell.shift import record_shift
    from refcell.world import load_world

    params = load_params(Path("params.yaml"))
    shift = record_shift(
        *(load_world("line"), params.cell, params.record, Expert(), 20, folder / "shift", 11),
        interventions=False,
        policy_version="expert",
        shift_start=datetime(2026, 12, 1, 6, tzinfo=UTC),
    )
    return {
        "honest shift log (baseline)": Path(shift["files"][0]),
        "zstd zeros, 1 GiB declared": mcap_bombs.zip_bomb(folder / "zip.mcap"),
        "zstd zeros, 60 MiB declared": mcap_bombs.ratio_bomb(folder / "ratio.mcap"),
        "600,000 empty records": mcap_bombs.record_flood(folder / "records.mcap", 600_000),
        "12,000 empty chunks": mcap_bombs.chunk_flood(folder / "chunks.mcap", 12_000),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        results = {name: measure(path) for name, path in files(Path(scratch)).items()}
    base = next(iter(results.values()))
    for row in results.values():
        row["rss_ratio"] = row["peak_rss_mb"] / base["peak_rss_mb"]
        row["time_ratio"] = row["seconds"] / base["seconds"]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'file':30} {'bytes':>10} {'peak MB':>8} {'x base':>7} {'s':>6} {'x base':>7}  outcome")
    for name, row in results.items():
        print(
            f"{name:30} {row['bytes']:>10} {row['peak_rss_mb']:>8.0f} {row['rss_ratio']:>7.2f} "
            f"{row['seconds']:>6.2f} {row['time_ratio']:>7.2f}  {row['outcome'][:70]}"
        )


if __name__ == "__main__":
    main()
