"""Several candidates per cell each cycle, and the pre-screen that sends only the best to trials.

    every cell first: split its batches by shift (the newest held out of fine-tuning, for the
        pre-screen; the `loop.train_shifts` before them trained on)
      → calibrate from its newest shifts, the held-out one included (up to
        loop.calibrate_episodes; once calibrate.min_episodes exist) → the policy pretrained in
        that sim, cached by the calibration's hash, or started now in a process of its own
        (one per core: the cells' pretrains run side by side)
    then per cell (one at a time: MLflow, the DVC stage):
      → incumbent_finetune: its production model fine-tuned (the finetune@<cell> DVC stage),
        in a worker thread while its pretrain finishes
      → calibrated: the calibration's policy registered as is; calibrated_finetune: it
        fine-tuned on the same batches
      → pre-screen: held-out action error + success in the calibrated sim; the best is the
        cell's candidate (`trained`), which the loop uploads and trials as before

`loop.candidates` says which are built. A candidate that cannot be built (too few episodes to
calibrate) is listed with its reason and the others go on; a cell fails only when none is
built. The simulator is a plug-in (params `simulator:`): nothing here imports a cell.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows import artifacts
from pipelines.contract.params import Params

THIN = {"cache_policy": NO_CACHE}  # stage results are never reused across runs
INCUMBENT_FINETUNE, CALIBRATED, CALIBRATED_FINETUNE = (
    "incumbent_finetune",
    "calibrated",
    "calibrated_finetune",
)


@task(name="split-by-shift", task_run_name="split {cell_id} by shift", **THIN)
def split_cell(params: Params, workspace: Path, cell_id: str, batches: list[str]) -> dict:
    from pipelines.release.prescreen import batch_shifts, split_by_shift, window

    dataset = workspace / params.ingest.dataset
    split = split_by_shift(batch_shifts(dataset, batches), params.loop.heldout_shifts)
    recorded = batch_shifts(dataset, split.train, trials=True)
    split = window(split, recorded, params.loop.train_shifts)
    return split.as_dict() | {"train": split.train, "heldout": split.heldout}


@task(name="fine-tune", task_run_name="fine-tune {cell_id}", **THIN)
def fine_tune(
    params: Params,
    workspace: Path,
    cell_id: str,
    plan: dict,
    dataset_version: str,
    cycle_no: int | None = None,
) -> dict:
    """A candidate from the cell's production model, trained on the cell's batches only."""
    from pipelines.release.cycle_record import fine_tune_cell

    base, batches = Path(plan["base"]), plan["batches"]
    started = time.monotonic()
    # The finetune@<cell> stage of dvc.yaml: its training set pinned, its metrics written.
    trained = fine_tune_cell(
        params, workspace, base, dataset_version, batches, cell_id, cycle=cycle_no
    )
    artifacts.log(artifacts.trained_sentence(cell_id, trained, time.monotonic() - started))
    run = artifacts.mlflow_run_link(workspace, trained["mlflow_run_id"])
    artifacts.link(artifacts.key(cell_id, "mlflow-run"), run, f"{cell_id}: the fine-tune run")
    return trained


@task(name="calibrate-cell", task_run_name="calibrate {cell_id}", **THIN)
def calibrate_cell(
    params: Params, workspace: Path, cell_id: str, batches: list[str], dataset_version: str
) -> dict:
    """The sim calibrated from the cell's newest shifts; the one in use when nothing moved
    beyond its standard errors (pipelines/calibrate/cache.py). `skip` says why there is none
    (too few episodes yet: expected on a new cell, so not a failed task)."""
    from flows.plugins import load_simulator
    from pipelines.training.calibrated import calibrate_cell as calibrate

    simulator, sim_world = load_simulator(params)
    try:
        chosen = calibrate(
            params, workspace, cell_id, batches, dataset_version, simulator, sim_world
        )
    except ValueError as exc:  # what the data cannot support yet, in one line
        artifacts.log(f"{cell_id}: no calibrated candidates this cycle: {exc}")
        return {"skip": f"calibration: {exc}"}
    what = "new" if chosen.new else "unchanged within its standard errors"
    artifacts.log(f"{cell_id}: calibration {chosen.hash} ({what}: {chosen.changed or '-'})")
    return _named_in(workspace, chosen.as_dict()) | {"skip": None}


@task(name="calibrated-policy", task_run_name="calibrated policy {cell_id}", **THIN)
def calibrated_policy(
    params: Params, workspace: Path, cell_id: str, calibration: dict, threads: int = 1
) -> dict:
    """The calibration's policy: cached, or pretrained now (params `simulator.pretrain`) in a
    process of its own on `threads` torch threads, so the cells' pretrains run side by side,
    one per core."""
    from flows.plugins import load_plugin
    from pipelines.release.prescreen import SimPretrain
    from pipelines.training.calibrated import ensure_calibrated_policy

    pretrain = load_plugin(params.simulator.pretrain, "simulator.pretrain", SimPretrain)
    cached = _cached(calibration, workspace)
    if cached.pretrained:
        policy = ensure_calibrated_policy(params, cached, pretrain)
    else:
        on_threads = replace(params, train=replace(params.train, threads=threads))
        with _PRETRAIN_SLOTS:
            policy = in_child_process(ensure_calibrated_policy, on_threads, cached, pretrain)
    how = "cached" if policy["cached"] else f"pretrained in {policy['seconds']} s"
    artifacts.log(f"{cell_id}: calibrated policy for {calibration['hash']} {how}")
    return policy


# Pretrains at once: one per core. Each is single-threaded Python and torch (the sim's rollouts,
# small batches), so a third beside two would only slow the first cell's.
_PRETRAIN_SLOTS = threading.BoundedSemaphore(os.cpu_count() or 1)


def in_child_process(function: Callable, *args):
    """`function(*args)` in a fresh process, and its result: CPU-bound Python beside the flow's
    own work, on another core. Spawned, not forked: the flow has threads (Prefect's, the
    fine-tune's) whose locks a fork would copy held. Arguments and result cross as pickles
    between this process and its own child, never from outside."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


@task(name="register-calibrated", task_run_name="register calibrated {cell_id}", **THIN)
def register_calibrated(
    params: Params,
    workspace: Path,
    cell_id: str,
    calibration: dict,
    dataset_version: str,
    cycle_no: int,
) -> dict:
    from pipelines.training.calibrated import register_calibrated as register

    cached = _cached(calibration, workspace)
    trained = register(params, workspace, cell_id, cached, cached.policy, dataset_version, cycle_no)
    artifacts.log(
        f"{cell_id}: calibrated candidate registered as version {trained['model_version']}"
    )
    return trained


@task(name="fine-tune-calibrated", task_run_name="fine-tune calibrated {cell_id}", **THIN)
def fine_tune_calibrated(
    params: Params,
    workspace: Path,
    cell_id: str,
    calibration: dict,
    batches: list[str],
    dataset_version: str,
    cycle_no: int,
) -> dict:
    """The calibrated policy fine-tuned on the cell's batches (not the DVC stage: that is the
    incumbent's), written beside the cell's calibrations."""
    from pipelines.training import fine_tune_and_register
    from pipelines.training.calibrated import FINETUNED_DIR, cell_folder

    started = time.monotonic()
    # A strong base: trained in loop.calibrated_finetune_mode (anchored), not train.mode.
    mode = replace(params.train, mode=params.loop.calibrated_finetune_mode)
    trained = fine_tune_and_register(
        replace(params, train=mode),
        workspace,
        _cached(calibration, workspace).policy,
        dataset_version,
        batches,
        cell_id,
        cycle=cycle_no,
        out=cell_folder(workspace, cell_id) / FINETUNED_DIR,
        stage="finetune-calibrated",
    )
    artifacts.log(artifacts.trained_sentence(cell_id, trained, time.monotonic() - started))
    return trained


@task(name="prescreen", task_run_name="prescreen {cell_id}", **THIN)
def prescreen(
    params: Params,
    workspace: Path,
    cell_id: str,
    built: list[dict],
    split: dict,
    calibration: dict | None,
) -> dict:
    """Rank the built candidates (pipelines/release/prescreen.py), record each one's figures
    on its MLflow run; the best is the one to trial."""
    from flows.plugins import load_plugin
    from pipelines.release.prescreen import ShiftSplit, SimEvaluate, prescreen_cell
    from pipelines.training.cycle_runs import log_prescreen

    evaluate = None
    if calibration is not None:
        evaluate = load_plugin(params.simulator.evaluate, "simulator.evaluate", SimEvaluate)
    shift_split = ShiftSplit(
        split["train"], split["heldout"], split["heldout_shifts"], split["train_shifts"]
    )
    path = None if calibration is None else workspace / calibration["path"]
    ranked, examples = prescreen_cell(params, workspace, shift_split, built, path, evaluate)
    log_prescreen(workspace, ranked)
    best = ranked[0]
    artifacts.log(
        f"{cell_id}: pre-screen of {len(ranked)} candidate(s): "
        + ", ".join(f"{c['name']} {_shown(c['score'])}" for c in ranked)
        + f"; {best['name']} goes to trials"
    )
    return {"ranked": ranked, "heldout_examples": examples}


def build(
    fleet,
    params: Params,
    root: Path,
    dataset_version: str,
    number: int,
    then: Callable[[str], None] | None = None,
) -> None:
    """Per cell still in the cycle: its candidates, the pre-screen, and the best as the cell's
    `trained` (what the loop uploads and trials). `fleet`: the loop's cells of the cycle.
    `then(cell_id)`: called as soon as a cell's candidate is chosen, before the next cell's
    build (the loop sends it to trials there).

    Every cell's calibration comes first, each starting the pretrain it needs in a process of
    its own: the pretrain is most of a cell's build, and one cell after another left a core
    idle while the fleet waited. Then cell by cell as before, each waiting for its own."""
    started, cells = {}, fleet.going()
    threads = _pretrain_threads(params, len(cells))
    for cell_id in cells:
        try:
            started[cell_id] = _start_cell(
                params, root, cell_id, fleet.steps[cell_id]["plan"], dataset_version, threads
            )
        except _NoCandidate as exc:
            fleet.errors[cell_id] = str(exc)
    for cell_id, begun in started.items():
        try:
            fleet.steps[cell_id] |= _build_cell(
                params, root, cell_id, fleet.steps[cell_id]["plan"], dataset_version, number, begun
            )
        except _NoCandidate as exc:
            fleet.errors[cell_id] = str(exc)
            continue
        if then is not None:
            then(cell_id)


@dataclass
class _Started:
    """A cell's build as far as `_start_cell` took it: its split, its calibration, and the
    calibration's policy on its way (None: no calibrated candidate this cycle, see `failed`)."""

    split: dict
    calibration: dict | None = None
    policy: object = None  # the calibrated-policy task's future
    failed: list[dict] = field(default_factory=list)


def _pretrain_threads(params: Params, cells: int) -> int:
    """torch threads per pretrain: train.threads, or the cores shared among the pretrains
    that may run at once (two torch pools spin-waiting on one core were 6.7x slower:
    bench/train_threads)."""
    cores = os.cpu_count() or 1
    return params.train.threads or max(1, cores // max(1, min(cells, cores)))


def _start_cell(params, root, cell_id, plan, dataset_version, threads) -> _Started:
    split = _result(split_cell(params, root, cell_id, plan["batches"], return_state=True), "split")
    begun = _Started(split)
    # The sim follows the line as it is now: calibrated from the newest shift, the held-out
    # one included (the pre-screen's action error does not read the calibration).
    newest = split["heldout"] + split["train"]
    begun.calibration, begun.policy = _calibrated_policy(
        params, root, cell_id, newest, dataset_version, begun.failed, threads
    )
    return begun


def _build_cell(params, root, cell_id, plan, dataset_version, number, begun: _Started) -> dict:
    wanted, common = params.loop.candidates, (params, root, cell_id)
    split, calibration, failed = begun.split, begun.calibration, begun.failed
    built = []
    incumbent = None
    if INCUMBENT_FINETUNE in wanted:
        # In a worker thread while the calibrated policy is pretrained in its own process.
        train_plan = plan | {"batches": split["train"]}
        incumbent = fine_tune.submit(*common, train_plan, dataset_version, number)
    policy = _pretrained(params, begun)
    if incumbent is not None:  # before the calibrated candidates register (MLflow, above)
        incumbent.wait()
        _keep(INCUMBENT_FINETUNE, incumbent.state, None, built, failed)
    if policy is not None:
        _calibrated_candidates(
            params, root, (cell_id, plan["base"]), calibration, split["train"],
            dataset_version, number, built, failed,
        )  # fmt: skip
    if not built:
        reasons = "; ".join(f"{f['name']}: {f['error']}" for f in failed)
        raise _NoCandidate(f"candidates: none built ({reasons})")
    in_sim = calibration or _last_calibration(root, cell_id)
    state = prescreen(*common, built, split, in_sim, return_state=True)
    screened = _result(state, "prescreen")
    ranked = screened["ranked"]
    summary = {
        "split": {k: v for k, v in split.items() if k not in ("train", "heldout")},
        "heldout_examples": screened["heldout_examples"],
        "calibration": calibration,
        "sim_calibration": _calibration_ref(in_sim),
        "candidates": [_row(c) for c in ranked] + failed,
        "trialled": _row(ranked[0]),
    }
    return {"trained": ranked[0]["trained"], "prescreen": summary}


def _wanted_calibrated(params: Params) -> list[str]:
    return [n for n in (CALIBRATED, CALIBRATED_FINETUNE) if n in params.loop.candidates]


def _calibrated_policy(params, root, cell_id, batches, dataset_version, failed, threads) -> tuple:
    """(the calibration, its policy's task future: cached or being pretrained), as far as they
    were made; what was not, with the reason, in `failed` for each calibrated candidate
    loop.candidates asks for. (None, None) when it asks for none."""
    wanted = _wanted_calibrated(params)
    if not wanted:
        return None, None
    common = (params, root, cell_id)
    state = calibrate_cell(*common, batches, dataset_version, return_state=True)
    calibration = _value(state)
    if calibration is None or calibration["skip"]:
        reason = _reason(state) if calibration is None else calibration["skip"]
        failed += [{"name": name, "error": reason} for name in wanted]
        return None, None
    return calibration, calibrated_policy.submit(*common, calibration, threads)


def _pretrained(params, begun: _Started) -> dict | None:
    """The cell's calibrated policy, once its pretrain is done; None (and why, in `failed`)
    when there is none."""
    if begun.policy is None:
        return None
    begun.policy.wait()
    if not begun.policy.state.is_completed():
        reason = _reason(begun.policy.state)
        begun.failed += [{"name": name, "error": reason} for name in _wanted_calibrated(params)]
        return None
    return begun.policy.result()


def _calibrated_candidates(
    params, root, cell, calibration, batches, dataset_version, number, built, failed
) -> None:
    """calibrated and calibrated_finetune, as loop.candidates asks, from the calibration's
    policy; appended to `built` or, with the reason, to `failed`. `cell`: its id and its
    production model's folder."""
    wanted = _wanted_calibrated(params)
    cell_id, production = cell
    common = (params, root, cell_id)
    if CALIBRATED in wanted and _same_weights(root / calibration["policy"], Path(production)):
        # Promoted in an earlier cycle and nothing moved since: no trial of a model against
        # itself.
        failed.append({"name": CALIBRATED, "error": "the production model already (same weights)"})
    elif CALIBRATED in wanted:
        state = register_calibrated(
            *common, calibration, dataset_version, number, return_state=True
        )
        _keep(CALIBRATED, state, calibration, built, failed)
    if CALIBRATED_FINETUNE in wanted:
        state = fine_tune_calibrated(
            *common, calibration, batches, dataset_version, number, return_state=True
        )
        _keep(CALIBRATED_FINETUNE, state, calibration, built, failed)


class _NoCandidate(Exception):
    """No candidate could be built for a cell: the cell's cycle fails with the reasons."""


def _keep(name, state, calibration, built, failed) -> None:
    if state.is_completed():
        trained = state.result()
        built.append(
            {
                "name": name,
                "policy_folder": trained["policy_folder"],
                "mlflow_run_id": trained["mlflow_run_id"],
                "model_version": trained["model_version"],
                "calibration": _calibration_ref(calibration),
                "trained": trained,
            }
        )
    else:
        failed.append({"name": name, "error": _reason(state)})


def _calibration_ref(calibration: dict | None) -> dict | None:
    """The calibration a candidate used, as its MLflow tags and the summary name it."""
    if calibration is None:
        return None
    return {"hash": calibration["hash"], "path": calibration["path"]}


def _row(candidate: dict) -> dict:
    """A candidate in the summary: its figures, not its whole training record."""
    return {k: v for k, v in candidate.items() if k != "trained"}


def _last_calibration(root: Path, cell_id: str) -> dict | None:
    """Without this cycle's calibration (too few episodes, or no calibrated candidate asked
    for): the cell's calibration in use, for the sim term of the pre-screen, if any."""
    from pipelines.calibrate.cache import current_calibration
    from pipelines.training.calibrated import cell_folder

    found = current_calibration(cell_folder(root, cell_id))
    return None if found is None else _named_in(root, found.as_dict())


def _named_in(root: Path, calibration: dict) -> dict:
    """Its files as the workspace names them: the summary and MLflow tags never hold an
    absolute path of this machine, and a moved workspace still finds them."""
    named = dict(calibration)
    for key in ("path", "policy"):
        path = Path(calibration[key]).resolve()
        if path.is_relative_to(root.resolve()):  # outside the workspace: kept as it is
            named[key] = str(path.relative_to(root.resolve()))
    return named


def _same_weights(a: Path, b: Path) -> bool:
    from pipelines.ingest import sha256_file
    from pipelines.training.policy import WEIGHTS_FILE

    return sha256_file(a / WEIGHTS_FILE) == sha256_file(b / WEIGHTS_FILE)


def _cached(calibration: dict, root: Path):
    """The task's record (paths as the workspace names them) as a CachedCalibration."""
    from pipelines.calibrate.cache import CachedCalibration

    return CachedCalibration(
        calibration["hash"],
        root / calibration["path"],
        root / calibration["policy"],
        list(calibration["changed"]),
        bool(calibration["new"]),
    )


def _result(state, step: str):
    if state.is_completed():
        return state.result()
    raise _NoCandidate(f"{step}: {_reason(state)}")


def _value(state):
    return state.result() if state.is_completed() else None


def _reason(state) -> str:
    error = state.result(raise_on_failure=False)
    return str(error).splitlines()[0] if error else str(state)


def _shown(value: float | None) -> str:
    return "unscored" if value is None else f"{value:.3f}"
