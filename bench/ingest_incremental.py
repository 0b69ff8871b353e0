"""Incremental ingest: the cost of adding one new log to a dataset of 500 sources vs of 5.

    .venv/bin/python -m bench.ingest_incremental [--large 500] [--small 5] [--json]
        [--repeats 7] [--direct-repeats 15]

One process, one Prefect ephemeral API (started by a warm-up ingest before anything is
timed). A short shift of line episodes is recorded once with the expert; every other log is a
copy of it under another shift id (the MCAP metadata and the episode ids in the events
rewritten to the same length, every other message copied raw), so each file is a distinct
source at the cost of a copy.

For each size, a fresh workspace (git + DVC with a local remote, as `realloop ingest` makes
it) first ingests `size` logs through the flow (setup, reported as bulk throughput), waits
until the API has recorded those task runs, and adds one log untimed. Then one new log lands
and the ingest flow runs, sizes alternating, in two modes:
(a) the flow's code without Prefect (each task replaced by the function it wraps),
    `direct_repeats` times per size;
(b) `ingest_flow` as `realloop ingest` runs it, `repeats` times per size: list the landing
    folder, one task for the new file, `dvc add`, git commit + tag, `dvc push`.
The figures are medians (and minima: this machine is shared, and the fastest run is the one
least disturbed). The target, large/small at most 1.5, is judged on both (b), the cost a user
pays, and (a), what grows with the dataset underneath Prefect's fixed cost per flow run.

Checked on every timed run: the files DVC hashed (dvc_data's file_md5, counted: only the new
source's files may be), the landing files realloop hashed (sha256_file calls), and that no
old file changed in the dataset, the landing folder or DVC's cache (inode, size, mtime_ns).
`dvc status` is timed on both workspaces afterwards: in-process (open the repo + status,
median of 5) and as the `dvc status` command (median of 3); both ratios are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

TARGET_RATIO = 1.5
SHIFT_START = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
EVENTS_TOPIC = "/episode_events"  # pipelines.contract.schema.TOPIC_EVENTS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ingest_incremental", description=__doc__)
    parser.add_argument("--large", type=int, default=500, help="sources in the large dataset")
    parser.add_argument("--small", type=int, default=5, help="sources in the small dataset")
    parser.add_argument("--repeats", type=int, default=7, help="timed flow runs per size")
    parser.add_argument(
        "--direct-repeats", type=int, default=15, help="timed runs without Prefect per size"
    )
    parser.add_argument("--episodes", type=int, default=2, help="episodes per recorded log")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    try:
        report = run(
            args.small,
            args.large,
            args.repeats,
            args.direct_repeats,
            args.episodes,
            args.params.resolve(),
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench.ingest_incremental: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0


def run(
    small: int, large: int, repeats: int, direct_repeats: int, episodes: int, params_path: Path
) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        tmp = Path(tmp)
        from flows.prefect_env import configure_prefect

        configure_prefect(tmp / "prefect")
        base = _record_base(tmp / "recorded", episodes, params_path)
        logs = tmp / "logs"
        needed = small + large + 2 + 2 * (repeats + direct_repeats)
        started = time.perf_counter()
        files = [_variant(base, logs, index) for index in range(needed)]
        variants_s = time.perf_counter() - started
        pool = iter(files)
        sizes = {"small": small, "large": large}
        workspaces, timed, direct = _measure(
            tmp, params_path, base, pool, sizes, repeats, direct_repeats
        )
        status = {label: _dvc_status(workspaces[label]["root"]) for label in sizes}
        base_bytes = base.stat().st_size
    result = {
        label: _size_result(size, workspaces[label], timed[label], direct[label], status[label])
        for label, size in sizes.items()
    }
    return {
        "base_log_bytes": base_bytes,
        "episodes_per_log": episodes,
        "variants_s": variants_s,
        "repeats": repeats,
        "direct_repeats": direct_repeats,
        **result,
        **_verdict(result, sizes),
        "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0]},
    }


def _measure(
    tmp: Path,
    params_path: Path,
    base: Path,
    pool: Iterator[Path],
    sizes: dict[str, int],
    repeats: int,
    direct_repeats: int,
) -> tuple[dict, dict[str, list[dict]], dict[str, list[dict]]]:
    """A workspace per size, set up from the pool's logs; then one log added at a time."""
    _setup(tmp / "warm-up", params_path, [base])  # the API server, imports, caches
    workspaces = {}
    for label, size in sizes.items():
        workspaces[label] = _setup(tmp / label, params_path, [next(pool) for _ in range(size)])
    for label in sizes:  # the first addition after a bulk ingest warms DVC's state
        _add_one(workspaces[label], next(pool), direct=True)
    timed: dict[str, list[dict]] = {label: [] for label in sizes}
    direct: dict[str, list[dict]] = {label: [] for label in sizes}
    # Without Prefect first (nothing of the API's working in the background), then
    # through it; sizes alternate so drift on this shared machine hits both.
    for _ in range(direct_repeats):
        for label in sizes:
            direct[label].append(_add_one(workspaces[label], next(pool), direct=True))
    for _ in range(repeats):
        for label in sizes:
            timed[label].append(_add_one(workspaces[label], next(pool)))
    return workspaces, timed, direct


def _size_result(
    size: int, workspace: dict, timed: list[dict], direct: list[dict], status: dict
) -> dict:
    """One size's figures: setup throughput, the additions' times and what they touched."""
    return {
        "sources_before": size,
        "setup_ingest_s": workspace["setup_s"],
        "setup_files_per_s": size / workspace["setup_s"],
        "add_one_s": [r["wall_s"] for r in timed],
        "add_one_median_s": statistics.median(r["wall_s"] for r in timed),
        "direct_add_one_s": [r["wall_s"] for r in direct],
        "direct_add_one_median_s": statistics.median(r["wall_s"] for r in direct),
        "direct_add_one_min_s": min(r["wall_s"] for r in direct),
        "add_one_min_s": min(r["wall_s"] for r in timed),
        "versioning_median_s": statistics.median(r["versioning_s"] for r in timed + direct),
        "dvc_hashed_files": [r["dvc_hashed"] for r in timed + direct],
        "landing_files_hashed": [r["landing_hashed"] for r in timed + direct],
        "old_files_checked": direct[-1]["old_files_checked"],
        "old_files_changed": sum(r["old_files_changed"] for r in timed + direct),
        "old_files_rehashed": sum(r["old_files_rehashed"] for r in timed + direct),
        "new_versions": sum(r["new_version"] for r in timed + direct),
        **status,
    }


def _verdict(result: dict, sizes: dict[str, int]) -> dict:
    """large/small ratios, and whether the target is met with no old file touched."""
    ratio = result["large"]["add_one_median_s"] / result["small"]["add_one_median_s"]
    direct_ratio = (
        result["large"]["direct_add_one_median_s"] / result["small"]["direct_add_one_median_s"]
    )
    direct_min_ratio = (
        result["large"]["direct_add_one_min_s"] / result["small"]["direct_add_one_min_s"]
    )
    return {
        "ratio": ratio,
        "direct_ratio": direct_ratio,
        "direct_min_ratio": direct_min_ratio,
        "target_ratio": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO
        and direct_ratio <= TARGET_RATIO
        and all(result[s]["old_files_changed"] == 0 for s in sizes)
        and all(result[s]["old_files_rehashed"] == 0 for s in sizes),
        "status_ratio": result["large"]["dvc_status_s"] / result["small"]["dvc_status_s"],
        "status_cli_ratio": result["large"]["dvc_status_cli_s"]
        / result["small"]["dvc_status_cli_s"],
    }


# --- the logs ------------------------------------------------------------------------------


def _record_base(folder: Path, episodes: int, params_path: Path) -> Path:
    """One log of `episodes` line episodes, recorded with the expert."""
    import yaml

    from flows.cell import run_record

    params = yaml.safe_load(params_path.read_text())
    params["record"]["episodes_per_file"] = episodes
    folder.mkdir(parents=True)
    small = folder / "params.yaml"
    small.write_text(yaml.safe_dump(params))
    summary = run_record(
        "expert", episodes, folder / "logs", 1, False, SHIFT_START.isoformat(), small
    )
    return Path(summary["files"][0])


def _shift_id(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")


def _variant(base: Path, folder: Path, index: int) -> Path:
    """`base` as if recorded in another shift: same bytes of every message but the events
    (episode ids) and the metadata, whose shift id is replaced by one of the same length."""
    old = _shift_id(SHIFT_START)
    new = _shift_id(SHIFT_START + timedelta(minutes=10 * (index + 1)))
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / base.name.replace(old, new)
    rewrite_log(base, out, lambda text: text.replace(old, new))
    return out


def rewrite_log(base: Path, out: Path, swap) -> None:
    """A copy of the MCAP log `base` at `out` with `swap` (str -> str, same length) applied to
    its metadata and its episode events; every other message copied byte for byte."""
    from mcap.reader import make_reader
    from mcap.writer import CompressionType, Writer

    with base.open("rb") as source, out.open("wb") as sink:
        reader = make_reader(source)
        header, summary = reader.get_header(), reader.get_summary()
        writer = Writer(sink, compression=CompressionType.ZSTD)
        writer.start(profile=header.profile, library=header.library)
        schemas = {
            sid: writer.register_schema(s.name, s.encoding, s.data)
            for sid, s in summary.schemas.items()
        }
        channels = {
            cid: writer.register_channel(
                c.topic, c.message_encoding, schemas.get(c.schema_id, 0), dict(c.metadata)
            )
            for cid, c in summary.channels.items()
        }
        for record in reader.iter_metadata():
            writer.add_metadata(record.name, {k: swap(v) for k, v in record.metadata.items()})
        for _, channel, message in reader.iter_messages(log_time_order=False):
            data = message.data
            if channel.topic == EVENTS_TOPIC:  # latin-1: every byte round-trips unchanged
                data = swap(data.decode("latin-1")).encode("latin-1")
            writer.add_message(
                channels[channel.id], message.log_time, data, message.publish_time, message.sequence
            )
        writer.finish()


# --- the workspaces ------------------------------------------------------------------------


def _setup(root: Path, params_path: Path, logs: list[Path]) -> dict:
    from flows.ingest import ingest_flow

    landing = root / "data" / "landing"
    landing.mkdir(parents=True)
    shutil.copy(params_path, root / "params.yaml")
    for log in logs:
        shutil.copy(log, landing / log.name)
    started = time.perf_counter()
    result = ingest_flow(str(root / "params.yaml"), str(root))
    setup_s = time.perf_counter() - started
    if result["ingest"]["files_ingested"] != len(logs):
        raise ValueError(f"setup ingested {result['ingest']['files_ingested']} of {len(logs)}")
    _settle(result["ingest"]["run_id"], len(logs) + 2)
    return {"root": root, "params": root / "params.yaml", "setup_s": setup_s}


def _settle(flow_run_id: str, task_runs: int, timeout_s: float = 300.0) -> None:
    """Wait until the local API has recorded the setup's task runs: its recorder works
    through their events in the background, on the same cores as the timed runs."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    runs = FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)]))
    done = TaskRunFilter(
        state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.COMPLETED]))
    )
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            recorded, page = 0, 200
            while True:
                batch = client.read_task_runs(
                    flow_run_filter=runs, task_run_filter=done, limit=page, offset=recorded
                )
                recorded += len(batch)
                if len(batch) < page:
                    break
            if recorded >= task_runs:
                break
            time.sleep(1.0)
    time.sleep(2.0)


def _add_one(workspace: dict, log: Path, direct: bool = False) -> dict:
    """Land one log and run the ingest flow; `direct`: its code without Prefect."""
    from flows.ingest import ingest_flow

    root = workspace["root"]
    before = _fingerprints(root)
    shutil.copy(log, root / "data" / "landing" / log.name)
    flow = ingest_flow.fn if direct else ingest_flow
    with (
        _counting_hashes() as hashed,
        _timing_versioning() as versioning_s,
        _without_prefect(direct),
    ):
        started = time.perf_counter()
        result = flow(str(workspace["params"]), str(root))
        wall_s = time.perf_counter() - started
    if result["ingest"]["files_ingested"] != 1:
        raise ValueError(f"{log.name}: expected one new file, got {result['ingest']}")
    after = _fingerprints(root)
    old_paths = {str(p) for p in before}
    return {
        "wall_s": wall_s,
        "versioning_s": versioning_s[0],
        "dvc_hashed": len(hashed["dvc"]),
        "landing_hashed": len(hashed["landing"]),
        "old_files_checked": len(before),
        "old_files_changed": sum(1 for p, f in before.items() if after.get(p) != f),
        "old_files_rehashed": sum(1 for p in hashed["dvc"] + hashed["landing"] if p in old_paths),
        "new_version": bool(result["dataset"]["new"]),
    }


def _fingerprints(root: Path) -> dict[Path, tuple[int, int, int]]:
    """(inode, size, mtime_ns) of every file in the dataset, landing folder and DVC cache."""
    found = {}
    for folder in (root / "data" / "dataset", root / "data" / "landing", root / ".dvc" / "cache"):
        for path in folder.rglob("*"):
            if path.is_file() and ".dir" not in path.suffixes:
                stat = path.stat()
                found[path] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return found


@contextmanager
def _without_prefect(enabled: bool) -> Iterator[None]:
    """Each task of the ingest flow swapped for the function it wraps (as bench.loop does)."""
    from prefect import Task

    import flows.ingest

    saved = [(name, value) for name, value in vars(flows.ingest).items() if isinstance(value, Task)]
    if enabled:
        for name, value in saved:
            setattr(flows.ingest, name, value.fn)
    try:
        yield
    finally:
        for name, value in saved:
            setattr(flows.ingest, name, value)


@contextmanager
def _counting_hashes() -> Iterator[dict[str, list[str]]]:
    """Record the paths DVC computes an md5 of, and the files realloop computes a sha256 of."""
    import dvc_data.hashfile.hash as dvc_hash

    from pipelines.ingest import landing as ingest

    hashed: dict[str, list[str]] = {"dvc": [], "landing": []}
    file_md5, sha256_file = dvc_hash.file_md5, ingest.sha256_file

    def counted_md5(path, *args, **kwargs):
        hashed["dvc"].append(str(path))
        return file_md5(path, *args, **kwargs)

    def counted_sha(path):
        hashed["landing"].append(str(Path(path)))
        return sha256_file(path)

    dvc_hash.file_md5, ingest.sha256_file = counted_md5, counted_sha
    try:
        yield hashed
    finally:
        dvc_hash.file_md5, ingest.sha256_file = file_md5, sha256_file


@contextmanager
def _timing_versioning() -> Iterator[list[float]]:
    from pipelines.ingest import versioning

    spent = [0.0]
    original = versioning.version_dataset

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    versioning.version_dataset = timed
    try:
        yield spent
    finally:
        versioning.version_dataset = original


def _dvc_status(root: Path) -> dict:
    from pipelines.ingest.dvc_repo import _dvc_repo

    times = []
    for _ in range(5):
        started = time.perf_counter()
        with _dvc_repo(root) as repo:
            status = repo.status()
        times.append(time.perf_counter() - started)
    if status:
        raise ValueError(f"{root}: dvc status is not clean: {status}")
    dvc = Path(sys.executable).with_name("dvc")
    cli = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([str(dvc), "status", "-q"], cwd=root, check=True, capture_output=True)
        cli.append(time.perf_counter() - started)
    return {"dvc_status_s": statistics.median(times), "dvc_status_cli_s": statistics.median(cli)}


# --- output -------------------------------------------------------------------------------


def _format(report: dict) -> str:
    rows = []
    for label in ("small", "large"):
        r = report[label]
        rows.append(
            f"| {r['sources_before']} | {r['direct_add_one_median_s']:.2f} s "
            f"(min {r['direct_add_one_min_s']:.2f}) "
            f"| {r['add_one_median_s']:.2f} s "
            f"({', '.join(f'{t:.2f}' for t in r['add_one_s'])}) | {r['versioning_median_s']:.2f} s "
            f"| {r['dvc_status_s'] * 1000:.0f} ms / {r['dvc_status_cli_s']:.2f} s "
            f"| {max(r['dvc_hashed_files'])} / {max(r['landing_files_hashed'])} "
            f"| {r['old_files_rehashed']} | {r['old_files_changed']} of {r['old_files_checked']} "
            f"| {r['setup_files_per_s']:.1f} files/s |"
        )
    verdict = "met" if report["met"] else "NOT met"
    return "\n".join(
        [
            f"Adding one log ({report['base_log_bytes']:,} bytes, {report['episodes_per_log']} "
            f"episodes), medians of {report['direct_repeats']} runs without Prefect and "
            f"{report['repeats']} through it:",
            "",
            "| sources before | add one, no Prefect | add one, `realloop ingest` flow (runs) "
            "| of which versioning | dvc status (API / CLI) "
            "| files hashed (DVC / landing) | old files re-hashed | old files changed "
            "| setup ingest |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"ratio {report['large']['sources_before']}/{report['small']['sources_before']}: "
            f"{report['ratio']:.2f} through the flow (target ≤ {report['target_ratio']}: "
            f"{verdict}), {report['direct_ratio']:.2f} without Prefect "
            f"({report['direct_min_ratio']:.2f} by the fastest runs); "
            f"dvc status ratio {report['status_ratio']:.2f} in-process, "
            f"{report['status_cli_ratio']:.2f} as the command",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
