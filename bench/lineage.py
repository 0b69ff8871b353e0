"""`realloop lineage` from both ends: a small workspace against a fleet-sized one, in one run.

    .venv/bin/python -m bench.lineage [--small 5] [--sources 500] [--versions 100]
        [--models 12] [--repeats 5] [--json]

One process. A short line shift (2 episodes) is recorded once with the expert, and every
other log is a copy of it under another shift id (bench.ingest_incremental's variants: the
MCAP metadata and episode ids rewritten, every other message copied raw), so each is a
distinct source. Each workspace (git + DVC with a local remote, as `realloop ingest` makes
it) is then filled the way the loop fills it, without the flow's per-run cost:

- its sources are ingested by `pipelines.ingest.landing.ingest_file` (the code of the flow's task)
  and versioned by `pipelines.ingest.versioning.version_dataset` in `versions` equal steps, so
  there are `versions` dataset versions (git commit + tag each), the last holding them all;
- `models` fine-tuning runs are recorded in the workspace's MLflow store as the retrain
  stage records them (run params, dataset version, training batches, registered tiny
  policy) and judged by a gate record with 2 + 2 trial logs: run k trains on dataset
  version k·versions/models, so the last model trains on every source.

Timed, sizes alternating, median of `repeats` warm calls each (and the minimum):
(a) `model_lineage` of the newest model version (it trained on every source), and once
    before those with no source index (`.realloop/lineage-sources.jsonl`, which that call
    fills from the episodes files);
(b) `file_lineage` of the first landed log (in every version and every model), by path;
(c) `file_lineage` of the same log by its sha256 (no file to hash);
and each of them once through `realloop lineage ... --json` in a fresh process (what a user
waits for, interpreter start and imports included). The outputs are checked: (a) lists
every source with its URI and episode count, (b) and (c) every dataset version and model.
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
import uuid
from datetime import UTC, datetime
from pathlib import Path

SMALL = {"sources": 5, "versions": 5, "models": 2}
TRIAL_LOGS = 2  # per role, per gate record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lineage", description=__doc__)
    parser.add_argument("--small", type=int, default=SMALL["sources"], help="small: sources")
    parser.add_argument("--sources", type=int, default=500, help="fleet: source logs")
    parser.add_argument("--versions", type=int, default=100, help="fleet: dataset versions")
    parser.add_argument("--models", type=int, default=12, help="fleet: model versions")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per way and size")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    sizes = {
        "small": {**SMALL, "sources": args.small, "versions": min(args.small, SMALL["versions"])},
        "fleet": {"sources": args.sources, "versions": args.versions, "models": args.models},
    }
    try:
        for size in sizes.values():
            if not 1 <= size["versions"] <= size["sources"] or size["models"] < 1:
                raise ValueError(f"need 1 <= versions <= sources and models >= 1: {size}")
            if size["sources"] < 2 * TRIAL_LOGS + 1:
                raise ValueError(f"need at least {2 * TRIAL_LOGS + 1} sources: {size}")
        report = run(sizes, args.repeats, args.params.resolve())
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench.lineage: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0


def run(sizes: dict[str, dict], repeats: int, params_path: Path) -> dict:
    from bench.ingest_incremental import _record_base
    from flows.prefect_env import configure_prefect

    with tempfile.TemporaryDirectory(prefix="bench-lineage-") as tmp:
        tmp = Path(tmp)
        configure_prefect(tmp / "prefect")
        base = _record_base(tmp / "recorded", 2, params_path)
        built = {
            label: _build(tmp / label, base, params_path, **size) for label, size in sizes.items()
        }
        cold = {label: _time_without_index(built[label]) for label in sizes}
        timed: dict[str, dict[str, list[float]]] = {
            label: {"model": [], "file": [], "sha": []} for label in sizes
        }
        for _ in range(repeats):
            for label in sizes:
                for way, seconds in _time_once(built[label]).items():
                    timed[label][way].append(seconds)
        cli = {label: _time_cli(built[label]) for label in sizes}
        result = {
            label: {
                **sizes[label],
                "build_s": built[label]["build_s"],
                "dataset_files": built[label]["dataset_files"],
                **{f"{way}_median_s": statistics.median(t) for way, t in timed[label].items()},
                **{f"{way}_min_s": min(t) for way, t in timed[label].items()},
                **{f"{way}_runs_s": t for way, t in timed[label].items()},
                **{f"cli_{way}_s": s for way, s in cli[label].items()},
                "model_without_index_s": cold[label],
            }
            for label in sizes
        }
    small, fleet = result["small"], result["fleet"]
    return {
        "repeats": repeats,
        **result,
        "ratios": {
            way: fleet[f"{way}_median_s"] / small[f"{way}_median_s"]
            for way in ("model", "file", "sha")
        }
        | {f"cli_{way}": fleet[f"cli_{way}_s"] / small[f"cli_{way}_s"] for way in cli["small"]}
        | {"model_without_index": fleet["model_without_index_s"] / small["model_without_index_s"]},
        "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0]},
    }


# --- building a workspace --------------------------------------------------------------------


def _build(
    root: Path, base: Path, params_path: Path, sources: int, versions: int, models: int
) -> dict:
    from bench.ingest_incremental import _variant
    from pipelines.contract.params import load_params
    from pipelines.ingest import ingest_file, versioning
    from pipelines.training import use_workspace

    started = time.perf_counter()
    root.mkdir(parents=True)
    shutil.copy(params_path, root / "params.yaml")
    params = load_params(root / "params.yaml")
    ingest = params.ingest
    landing, dataset = root / ingest.landing, root / ingest.dataset
    quarantine = root / ingest.quarantine
    landing.mkdir(parents=True)
    versioning.ensure_workspace(root, ingest.remote, unversioned=(landing, quarantine))
    logs = [_variant(base, landing, index) for index in range(sources)]
    bounds = [round(sources * (k + 1) / versions) for k in range(versions)]
    made, shas, run_id = [], [], str(uuid.uuid4())
    for k, end in enumerate(bounds):
        for log in logs[bounds[k - 1] if k else 0 : end]:
            result = ingest_file(
                log, landing, dataset, quarantine, params.cell, ingest, run_id,
                ingested_at=datetime.now(UTC),
            )  # fmt: skip
            if result.result != "ingested":
                raise ValueError(f"{log.name}: {result.result}: {result.reason}")
            shas.append(result.sha256)
        made.append(versioning.version_dataset(root, dataset, push=False))
    if len({v.version for v in made}) != versions:
        raise ValueError("every step should have made a new dataset version")
    use_workspace(root)
    model_versions = [_record_model(root, params, made, shas, k, models) for k in range(models)]
    return {
        "root": root,
        "params": params,
        "first_log": logs[0],
        "first_sha": shas[0],
        "sources": sources,
        "dataset_versions": [v.version for v in made],
        "model_versions": model_versions,
        "dataset_files": made[-1].files,
        "build_s": time.perf_counter() - started,
    }


def _record_model(root: Path, params, made: list, shas: list[str], k: int, models: int) -> str:
    """One fine-tuning run as the retrain stage records it, registered and gated."""
    from pipelines.ingest import versioning
    from pipelines.training import (
        PolicyConfig,
        PolicyNet,
        log_training_batches,
        record_gate,
        register_policy,
        save_policy,
        start_finetune_run,
    )

    version = made[round(len(made) * (k + 1) / models) - 1].version
    batches = versioning.version_sources(root, version)
    folder = save_policy(
        PolicyNet(PolicyConfig(hidden=[8], version=f"bench-{k}", trained_on={})),
        root / "models" / f"candidate-{k}",
    )
    train = params.train
    profile = {"episodes": 2 * len(batches)}
    with start_finetune_run(
        root, train.experiment, train, version, str(root / params.ingest.dataset), profile
    ) as run:
        run_id = run.info.run_id
        log_training_batches(batches, "sim-policy")
        model_version = register_policy(
            run_id,
            folder,
            train.registered_model,
            tags={"dataset_version": version, "base_policy": "sim-policy"},
        )
    # The trial logs: sources the gate judged the candidate and the incumbent on.
    offset = (k * 2 * TRIAL_LOGS) % (len(shas) - 2 * TRIAL_LOGS) + 1
    trials = shas[offset : offset + 2 * TRIAL_LOGS]
    gate = {
        "passed": k % 2 == 0,
        "reasons": [] if k % 2 == 0 else ["candidate success rate not above the incumbent's"],
        "candidate": {"episodes": 2 * TRIAL_LOGS, "success_rate": 0.5},
        "incumbent": {"episodes": 2 * TRIAL_LOGS, "success_rate": 0.5},
        "trial_sources": {"candidate": trials[:TRIAL_LOGS], "incumbent": trials[TRIAL_LOGS:]},
    }
    record_gate(train.registered_model, model_version, gate, run_id)
    return model_version


# --- timing ----------------------------------------------------------------------------------


def _time_once(built: dict) -> dict[str, float]:
    from pipelines.release import file_lineage, model_lineage
    from pipelines.training import use_workspace

    root, params = built["root"], built["params"]
    dataset, model = root / params.ingest.dataset, params.train.registered_model
    use_workspace(root)
    times = {}
    started = time.perf_counter()
    result = model_lineage(root, dataset, model, built["model_versions"][-1])
    times["model"] = time.perf_counter() - started
    _check_model(built, result)
    for way, target in (("file", str(built["first_log"])), ("sha", built["first_sha"])):
        started = time.perf_counter()
        result = file_lineage(root, dataset, model, target)
        times[way] = time.perf_counter() - started
        _check_file(built, result)
    return times


def _time_without_index(built: dict) -> float:
    """(a) once with no source index: every source read from its episodes file (and indexed),
    as on the first lineage call after an upgrade, or after the index was deleted."""
    from pipelines.release import SOURCE_INDEX, model_lineage
    from pipelines.training import use_workspace

    root, params = built["root"], built["params"]
    use_workspace(root)
    (root / SOURCE_INDEX).unlink(missing_ok=True)
    started = time.perf_counter()
    result = model_lineage(
        root, root / params.ingest.dataset, params.train.registered_model,
        built["model_versions"][-1],
    )  # fmt: skip
    seconds = time.perf_counter() - started
    _check_model(built, result)
    return seconds


def _time_cli(built: dict) -> dict[str, float]:
    """Each way once as `realloop lineage ... --json` in a fresh process."""
    realloop = Path(sys.executable).with_name("realloop")
    targets = {
        "model": built["model_versions"][-1],
        "file": str(built["first_log"]),
        "sha": built["first_sha"],
    }
    times = {}
    for way, target in targets.items():
        started = time.perf_counter()
        done = subprocess.run(
            [str(realloop), "lineage", target, "--json"],
            cwd=built["root"],
            capture_output=True,
            text=True,
            check=False,
        )
        times[way] = time.perf_counter() - started
        if done.returncode != 0:
            raise ValueError(f"realloop lineage {target}: {done.stderr.strip()}")
        result = json.loads(done.stdout)
        (_check_model if way == "model" else _check_file)(built, result)
    return times


def _check_model(built: dict, result: dict) -> None:
    sources = result["sources"]
    if (
        len(sources) != built["sources"]
        or result["dataset_version"] != built["dataset_versions"][-1]
    ):
        raise ValueError(f"model lineage: {len(sources)} sources of {built['sources']}")
    if not all(s["uri"] and s["episodes"] == 2 for s in sources):
        raise ValueError("model lineage: a source without its URI or episode count")
    if sum(len(t["sources"]) for t in result["trials"].values()) != 2 * TRIAL_LOGS:
        raise ValueError("model lineage: trial sources missing")


def _check_file(built: dict, result: dict) -> None:
    if result["dataset_versions"] != built["dataset_versions"]:
        raise ValueError(
            f"file lineage: {len(result['dataset_versions'])} dataset versions of "
            f"{len(built['dataset_versions'])}"
        )
    if [m["version"] for m in result["models"]] != built["model_versions"]:
        raise ValueError(f"file lineage: {len(result['models'])} models")
    if result["source"]["uri"] is None or result["sha256"] != built["first_sha"]:
        raise ValueError("file lineage: the file's source is not described")


# --- output ----------------------------------------------------------------------------------


def _format(report: dict) -> str:
    rows = []
    for label in ("small", "fleet"):
        r = report[label]
        rows.append(
            f"| {r['sources']} sources, {r['versions']} versions, {r['models']} models "
            f"| {r['model_median_s'] * 1000:.0f} ms (min {r['model_min_s'] * 1000:.0f}) "
            f"| {r['file_median_s'] * 1000:.0f} ms (min {r['file_min_s'] * 1000:.0f}) "
            f"| {r['sha_median_s'] * 1000:.0f} ms (min {r['sha_min_s'] * 1000:.0f}) "
            f"| {r['model_without_index_s'] * 1000:.0f} ms "
            f"| {r['cli_model_s']:.2f} / {r['cli_file_s']:.2f} / {r['cli_sha_s']:.2f} s "
            f"| {r['build_s']:.0f} s |"
        )
    ratios = report["ratios"]
    return "\n".join(
        [
            f"`lineage`, warm (median of {report['repeats']}), and `realloop lineage --json` "
            "in a fresh process:",
            "",
            "| workspace | (a) from the newest model | (b) from a file (path) "
            "| (c) from a sha256 | (a) without the index | command: a / b / c | build |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            "fleet/small: " + ", ".join(f"{way} {value:.2f}" for way, value in ratios.items()),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
