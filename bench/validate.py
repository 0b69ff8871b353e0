"""Validating a 1,000,000-step batch with the GX suites, against pyarrow.compute doing the same.

    .venv/bin/python -m bench.validate [--steps 1000000] [--captures 500] [--json]

One run writes a synthetic batch as ingest stores it (episodes and steps Parquet, captures
with their PNG snapshots in a landing folder, attachments in the dataset's store), valid
under every expectation, then measures:

(a) cold: `validate_dataset` in a fresh subprocess, from interpreter start to the stored
    result and the version's Data Docs, with GX's import and start-up (target: under 10 s);
(b) warm: `validate_batch` on the tables in memory, GX context built (best of --repeats);
(c) floor: the same checks written directly with pyarrow.compute (and numpy where pyarrow
    has no kernel; `bench.validate_floor`), on the same tables (best of --repeats). Target:
    (b) at most 5x (c).

Both sides are then run on a copy with a few rows broken, and their counts of offending rows
compared check by check: the suites check exactly what the floor checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.validate_floor import pyarrow_checks

TARGET_COLD_S = 10.0
TARGET_RATIO = 5.0
EPISODE_STEPS = 100
BATCH = hashlib.sha256(b"bench.validate").hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.validate", description=__doc__)
    parser.add_argument("--steps", type=int, default=1_000_000, help="steps in the batch")
    parser.add_argument("--captures", type=int, default=500, help="edge-case captures in it")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of (b) and (c)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    try:
        report = run(args.steps, args.captures, args.repeats, args.params.resolve())
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench.validate: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0 if report["agreement"]["equal"] else 1


def run(steps: int, captures: int, repeats: int, params_path: Path) -> dict:
    from pipelines.contract.params import load_params

    params = load_params(params_path)
    with tempfile.TemporaryDirectory(prefix="realloop-bench-validate-") as tmp:
        root = Path(tmp)
        dataset, landing = write_batch(root, steps, captures, params.cell)
        cold = _cold(dataset, landing, params_path)
        warm = _warm(dataset, landing, params, repeats)
    return {
        "steps": steps,
        "episodes": steps // EPISODE_STEPS,
        "captures": captures,
        "cold": cold,
        **warm,
        "ratio": warm["warm_s"] / warm["floor_s"],
        "targets": {"cold_s": TARGET_COLD_S, "ratio": TARGET_RATIO},
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


# --- the batch -------------------------------------------------------------------------------


def write_batch(root: Path, steps: int, captures: int, cell) -> tuple[Path, Path]:
    """A valid batch of `steps` steps (100 per episode) as ingest stores it; returns the
    dataset folder and the landing folder holding the captures."""
    from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA
    from pipelines.ingest import storage_schema

    dataset, landing = root / "data" / "dataset", root / "data" / "landing"
    for folder in ("episodes", "steps", "attachments"):
        (dataset / folder).mkdir(parents=True)
    (landing / "captures").mkdir(parents=True)
    episodes, step_table = make_tables(steps, captures, cell)
    episodes = _add_captures(episodes, captures, landing / "captures", dataset / "attachments")
    for name, table, contract in (
        ("steps", step_table, STEPS_SCHEMA),
        ("episodes", episodes, EPISODES_SCHEMA),
    ):
        stored = table.cast(storage_schema(contract))
        pq.write_table(stored, dataset / name / f"{BATCH}.parquet", compression="zstd")
    return dataset, landing


def make_tables(steps: int, captures: int, cell) -> tuple[pa.Table, pa.Table]:
    from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA

    rng = np.random.default_rng(7)
    n_episodes = max(1, steps // EPISODE_STEPS)
    n = n_episodes * EPISODE_STEPS
    ids = np.array([f"{cell.cell_id}-20260101T060000Z-{i:05d}" for i in range(n_episodes)])
    start = datetime(2026, 1, 1, 6, tzinfo=UTC)
    # Every third episode: the operator drives steps 20..29 (one takeover).
    takeover = np.arange(n_episodes) % 3 == 0
    step = np.tile(np.arange(EPISODE_STEPS, dtype=np.int32), n_episodes)
    intervention = np.repeat(takeover, EPISODE_STEPS) & (step >= 20) & (step < 30)
    action = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    corrected = pa.FixedSizeListArray.from_arrays(
        pa.array(action.reshape(-1)), 2, mask=pa.array(~intervention)
    )
    steps_table = pa.table(
        {
            "episode_id": pa.array(np.repeat(ids, EPISODE_STEPS)),
            "step": step,
            "time_s": step / cell.control_hz,
            "joint_position": _vectors(rng.uniform(-0.25, 0.25, (n, 2))),
            "joint_velocity": _vectors(rng.uniform(-0.3, 0.3, (n, 2))),
            "part_pose": _vectors(rng.uniform(-0.2, 0.2, (n, 3))),
            "part_confidence": rng.uniform(0.3, 1.0, n).astype(np.float32),
            "action": _vectors(action),
            "intervention": intervention,
            "corrected_action": corrected,
        },
        schema=STEPS_SCHEMA,
    )
    none = [None] * n_episodes
    episodes = pa.table(
        {
            "episode_id": ids,
            "cell_id": [cell.cell_id] * n_episodes,
            "robot_serial": [cell.robot_serial] * n_episodes,
            "policy_version": ["sim-policy-1"] * n_episodes,
            "sensor_calibration_id": [cell.sensor_calibration_id] * n_episodes,
            "software_version": ["cellsw-3.2"] * n_episodes,
            "source_uri": [f"data/landing/{cell.cell_id}_20260101T060000Z_0000.mcap"] * n_episodes,
            "source_sha256": [BATCH] * n_episodes,
            "source_chunk": [f"{i * 1000}-{i * 1000 + 999}" for i in range(n_episodes)],
            "ingest_run_id": ["bench"] * n_episodes,
            "ingested_at": [start + timedelta(days=1)] * n_episodes,
            "realloop_version": ["0.1.0"] * n_episodes,
            "start_time": [start + timedelta(seconds=8 * i) for i in range(n_episodes)],
            "target": _vectors(rng.uniform(-0.2, 0.2, (n_episodes, 2))),
            "part_extent_m": _vectors(np.full((n_episodes, 2), 0.04)),
            "success": np.ones(n_episodes, bool),
            "failure_cause": pa.nulls(n_episodes, pa.string()),
            "safety_stops": np.zeros(n_episodes, np.int32),
            "safety_stop_kind": pa.nulls(n_episodes, pa.string()),
            "interventions": takeover.astype(np.int32),
            "steps": np.full(n_episodes, EPISODE_STEPS, np.int32),
            "cycle_time_s": np.full(n_episodes, EPISODE_STEPS / cell.control_hz, np.float32),
            "edge_case": np.zeros(n_episodes, bool),
            "edge_case_reasons": pa.array(none, pa.list_(pa.string())),
            "attachments": pa.array(none, pa.list_(pa.string())),
            "trial_request_id": pa.nulls(n_episodes, pa.string()),
            "trial_arm": pa.nulls(n_episodes, pa.string()),
            "trial_attempt": pa.nulls(n_episodes, pa.string()),
        },
        schema=EPISODES_SCHEMA,
    )
    return episodes, steps_table.combine_chunks()


def _vectors(values: np.ndarray) -> pa.FixedSizeListArray:
    values = np.asarray(values, np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def _add_captures(episodes: pa.Table, count: int, captures: Path, store: Path) -> pa.Table:
    """One operator_flag capture (sidecar and a small PNG) for each of the first `count`
    episodes the operator drove, the PNG also in the dataset's attachment store."""
    ids = episodes.column("episode_id").to_pylist()
    driven = [i for i, runs in enumerate(episodes.column("interventions").to_pylist()) if runs]
    flags = episodes.column("edge_case").to_pylist()
    reasons = episodes.column("edge_case_reasons").to_pylist()
    shas = episodes.column("attachments").to_pylist()
    start = datetime(2026, 1, 1, 6, tzinfo=UTC)
    for index in driven[:count]:
        episode_id, name = ids[index], f"{ids[index]}_operator_flag"
        png = b"\x89PNG\r\n\x1a\n" + hashlib.sha256(episode_id.encode()).digest() * 64
        (captures / f"{name}.png").write_bytes(png)
        sha = hashlib.sha256(png).hexdigest()
        (store / f"{sha}.png").write_bytes(png)
        time_ = start + timedelta(seconds=8 * index + 1.0)
        sidecar = {
            "reason": "operator_flag",
            "time": time_.isoformat(),
            "log_time_ns": int(time_.timestamp() * 1e9),
            "episode_id": episode_id,
            "step": 20,
            "operator_note": "operator took over from the policy",
            "cell_id": episode_id.split("-2026")[0],
            "source_log": "bench.mcap",
            "attachments": [f"{name}.png"],
        }
        (captures / f"{name}.json").write_text(json.dumps(sidecar))
        flags[index], reasons[index], shas[index] = True, ["operator_flag"], [sha]
    marked = (("edge_case", flags), ("edge_case_reasons", reasons), ("attachments", shas))
    for column, values in marked:
        at = episodes.schema.get_field_index(column)
        field = episodes.schema.field(at)
        episodes = episodes.set_column(at, field, pa.array(values, field.type))
    return episodes


def suite_counts(gx_results: dict) -> dict[str, int]:
    """Offending rows per expectation, as realloop filled them into GX's results."""
    counts = {}
    for table, outcome in gx_results.items():
        for result in outcome["results"]:
            config = result["expectation_config"]
            if "unexpected_count" not in result.get("result", {}):
                continue
            kwargs = config["kwargs"]
            column = kwargs.get("column") or kwargs.get("column_A")
            kind = config["type"].removeprefix("expect_").removeprefix("column_values_to_")
            key = f"{table}.{column}:{kind}:{config['meta']['severity']}"
            counts[key] = result["result"]["unexpected_count"]
    return counts


def break_rows(episodes: pa.Table, steps: pa.Table) -> tuple[pa.Table, pa.Table]:
    """A copy with a few rows broken, critical and warning, in steps and episodes."""

    def edit(table, column, changes):
        values = table.column(column).to_pylist()
        for row, value in changes.items():
            values[row] = value(values[row]) if callable(value) else value
        at = table.schema.get_field_index(column)
        return table.set_column(
            at, table.schema.field(at), pa.array(values, table.schema.field(at).type)
        )

    steps = edit(steps, "part_confidence", {5: 1.5, 6: None})
    steps = edit(
        steps, "action", {12: [1.2, 0.0], 13: [0.0, -1.5], 21: lambda a: [a[0] + 0.01, a[1]]}
    )
    steps = edit(steps, "time_s", {205: lambda t: t + 0.02, 333: lambda t: t + 0.0005})
    steps = edit(steps, "joint_position", {300: [0.3, 0.0], 301: [float("nan"), 0.1]})
    steps = edit(steps, "intervention", {401: True})
    steps = edit(steps, "step", {502: 7})
    episodes = edit(episodes, "cycle_time_s", {3: 7.0})
    episodes = edit(episodes, "failure_cause", {4: "exploded"})
    episodes = edit(episodes, "steps", {6: 99})
    episodes = edit(episodes, "safety_stop_kind", {9: "speed"})
    return episodes, steps


# --- measuring -------------------------------------------------------------------------------

_COLD = """
import json, sys, time
started = time.perf_counter()
from pathlib import Path
from pipelines.contract.params import load_params
from pipelines.quality.validate import validate_dataset
params = load_params(sys.argv[1])
imported = time.perf_counter()
report = validate_dataset(
    Path(sys.argv[2]), params.cell, params.validate, captures=Path(sys.argv[3]),
    dataset_version="bench",
)
done = time.perf_counter()
print(json.dumps({
    "imports_s": imported - started, "validate_dataset_s": done - imported,
    "passed": report.passed_batches == [report.batches[0].batch],
    "failures": report.batches[0].failures, "warnings": report.batches[0].warnings,
    "data_docs": report.data_docs,
}))
"""


def _cold(dataset: Path, landing: Path, params_path: Path) -> dict:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _COLD, str(params_path), str(dataset), str(landing / "captures")],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    wall = time.perf_counter() - started
    if done.returncode:
        raise ValueError(f"cold run failed: {done.stderr.strip().splitlines()[-1]}")
    inside = json.loads(done.stdout)
    docs = Path(inside.pop("data_docs"))
    pages = (docs.parent / "validations").rglob("*.html")  # GX's pages, in its site layout
    inside["data_docs_written"] = docs.is_file() and any(pages)
    return {"wall_s": wall, **inside}


def _warm(dataset: Path, landing: Path, params, repeats: int) -> dict:
    from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA
    from pipelines.quality.validate import run as validate

    cell, v = params.cell, params.validate
    captures, store = landing / "captures", dataset / "attachments"
    started = time.perf_counter()
    validate.warm_up()
    gx_start = time.perf_counter() - started
    started = time.perf_counter()
    episodes = validate._read_table(dataset / "episodes" / f"{BATCH}.parquet", EPISODES_SCHEMA)
    steps = validate._read_table(dataset / "steps" / f"{BATCH}.parquet", STEPS_SCHEMA)
    read_s = time.perf_counter() - started

    def suites():
        return validate.validate_batch(episodes, steps, BATCH, cell, v, captures, store)

    def floor():
        return pyarrow_checks(episodes, steps, BATCH, cell, v, captures, store)

    first = suites()  # GX's first validation in a process pays for lazy imports
    floor()
    warm_s, floor_s = _best(suites, repeats), _best(floor, repeats)

    shutil.rmtree(validate.validation_root(dataset), ignore_errors=True)
    started = time.perf_counter()
    validate.validate_dataset(dataset, cell, v, captures=captures, dataset_version="bench")
    dataset_s = time.perf_counter() - started
    started = time.perf_counter()
    cached = validate.validate_dataset(dataset, cell, v, captures=captures, dataset_version="bench")
    cached_s = time.perf_counter() - started

    broken_episodes, broken_steps = break_rows(episodes, steps)
    _, gx_results = validate._check_batch(
        broken_episodes, broken_steps, BATCH, cell, v, captures, store
    )
    ours = suite_counts(gx_results)
    theirs = pyarrow_checks(broken_episodes, broken_steps, BATCH, cell, v, captures, store)
    compared = sorted(set(ours) & set(theirs))
    differ = {k: (ours[k], theirs[k]) for k in compared if ours[k] != theirs[k]}
    return {
        "gx_start_s": gx_start,
        "read_s": read_s,
        "warm_s": warm_s,
        "floor_s": floor_s,
        "clean_batch": {
            "passed": first.passed,
            "failures": first.failures,
            "warnings": first.warnings,
        },
        "dataset_s": dataset_s,
        "cached_s": cached_s,
        "cached_reused": cached.batches[0].cached,
        "agreement": {
            "checks_compared": len(compared),
            "only_in_suites": sorted(set(ours) - set(theirs)),
            "only_in_floor": sorted(set(theirs) - set(ours)),
            "broken": {k: ours[k] for k in compared if ours[k]},
            "differ": differ,
            "equal": not differ and len(compared) == len(ours) == len(theirs),
        },
    }


def _best(call, repeats: int) -> float:
    best = float("inf")
    for _ in range(max(1, repeats)):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def _format(r: dict) -> str:
    cold, agreement = r["cold"], r["agreement"]

    def ok(passed: bool) -> str:
        return "met" if passed else "MISSED"

    lines = [
        f"batch: {r['steps']:,} steps, {r['episodes']:,} episodes, {r['captures']} captures",
        f"(a) cold, subprocess: {cold['wall_s']:.2f} s wall ({cold['imports_s']:.2f} s imports, "
        f"{cold['validate_dataset_s']:.2f} s validate_dataset incl. GX start, Data Docs) "
        f"- target < {TARGET_COLD_S:.0f} s: {ok(cold['wall_s'] < TARGET_COLD_S)}",
        f"(b) warm, GX suites: {r['warm_s'] * 1000:.0f} ms "
        f"(GX start-up {r['gx_start_s']:.2f} s, Parquet read {r['read_s'] * 1000:.0f} ms apart)",
        f"(c) floor, pyarrow.compute: {r['floor_s'] * 1000:.0f} ms",
        f"ratio (b)/(c): {r['ratio']:.2f} - target <= {TARGET_RATIO:.0f}: "
        f"{ok(r['ratio'] <= TARGET_RATIO)}",
        f"validate_dataset warm with results and Data Docs: {r['dataset_s']:.2f} s; "
        f"again, stored result reused: {r['cached_s'] * 1000:.0f} ms "
        f"(reused: {r['cached_reused']})",
        f"clean batch passed: {r['clean_batch']['passed']}, warnings: "
        f"{len(r['clean_batch']['warnings'])}",
        f"agreement on a broken copy: {agreement['checks_compared']} checks compared, "
        f"{len(agreement['broken'])} broken, counts equal: {agreement['equal']}",
        f"machine: {r['machine']['cpus']} CPUs, load average "
        + ", ".join(f"{x:.2f}" for x in r["machine"]["load_average"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
