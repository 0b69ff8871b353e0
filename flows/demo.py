"""`realloop demo` (`make demo`): the deployment shape end to end on one machine.

Reference cells run as separate processes (`realloop cell run`), each with its own line, edge
box and clock, and meet the orchestrator only through storage: a landing zone and an edge
channel, folders by default or an S3-compatible server on loopback (REALLOOP_DEMO_S3=1). The
demo pretrains the sim policy if it is absent, deploys it to each cell as its first
production model (a recorded override), lets each cell record a shift, then runs loop cycles
until every cell has had one gated promotion or `demo.max_cycles` cycles have passed, waits
for each promoted cell's box to take its release, stops the cells cleanly and prints one row
per cycle and cell.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer
import yaml

from flows.console import CommandError, emit, fails_cleanly, stderr, stdout, stopped_like_ctrl_c

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]
DEMO_DIR = Path(".realloop/demo")  # the demo's params, the cells' boxes and logs
S3_ENV = "REALLOOP_DEMO_S3"
CELL_STOP_S = 120.0  # SIGTERM lets a cell finish its episode and upload; then SIGKILL
BOX_PULL_S = 60.0  # a cell pulls between episodes, every few seconds: time to take its release


@dataclass
class Fleet:
    """The demo's view of the shop floor: where cells upload, where models go, the processes."""

    landing: str
    channel: str
    cells: list[str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    # The channel's root metadata, handed to each box out of band as a real box gets it. The
    # first `deploy --initial` makes the keys in the workspace (promote.keys, root in offline/).
    root: Path | None = None

    @property
    def source(self) -> str | None:
        """What the loop ingests from: None is params' landing folder."""
        return self.landing if self.landing.startswith("s3://") else None


@fails_cleanly
def demo_command(params_path: ParamsOpt = Path("params.yaml"), as_json: JsonOpt = False) -> None:
    """Cells as processes, the loop until each cell is promoted once (see `make demo`)."""
    from pipelines.contract.params import load_params

    started = time.monotonic()
    params = load_params(params_path)
    with _stores(params) as (landing, channel):
        fleet = Fleet(landing, channel, list(params.demo.cells))
        demo_params = _write_demo_params(params_path, fleet)
        _ensure_sim_policy(params_path, params.pretrain.out)
        for cell in fleet.cells:
            deploy_initial(demo_params, params.pretrain.out, cell)
        fleet.root = _keys_folder(params) / "root.json"
        with running_cells(fleet, params.demo):
            shift_files = -(-params.demo.episodes_per_shift // params.record.episodes_per_file)
            wait_for_shifts(fleet, shift_files, params.demo.first_shift_timeout_s)
            cycles = _run_cycles(demo_params, fleet, params.demo.max_cycles, as_json)
            wait_for_boxes(promoted_versions(cycles), BOX_PULL_S)
    report = {
        "cycles": cycles,
        "boxes": {cell: box_status(cell) for cell in fleet.cells},
        "wall_s": round(time.monotonic() - started, 1),
    }
    emit(report, as_json, _print_report)


# --- stores and params ---------------------------------------------------------------------


@contextmanager
def _stores(params):
    """(landing, channel): params' folders, or prefixes on an S3 server started on loopback."""
    if not os.environ.get(S3_ENV):
        yield str(Path(params.ingest.landing).resolve()), str(Path(params.promote.channel))
        return
    with _loopback_s3() as bucket:
        yield f"s3://{bucket}/landing", f"s3://{bucket}/channel"


@contextmanager
def _loopback_s3():
    """An S3-compatible server (moto) on 127.0.0.1 with one bucket; children inherit its URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(
        REALLOOP_S3_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", "demo"),
        AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", "demo"),
        AWS_DEFAULT_REGION=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    )
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="realloop-demo")
    stderr.print(f"demo: S3-compatible server on {endpoint}, bucket realloop-demo")
    try:
        yield "realloop-demo"
    finally:
        server.stop()


def _write_demo_params(params_path: Path, fleet: Fleet) -> Path:
    """params.yaml with the demo's fleet, trial size and polling: the loop reads only params."""
    document = yaml.safe_load(Path(params_path).read_text())
    demo = document["demo"]
    document["fleet"]["cells"] = list(fleet.cells)
    document["trials"] |= {
        "max_episodes": demo["trial_episodes"],
        "poll_s": demo["poll_s"],
        "timeout_s": demo["trial_timeout_s"],
    }
    document["promote"]["channel"] = fleet.channel
    # The cells run on the same cores: fine-tuning on one thread is 6.7x faster beside them.
    document["train"]["threads"] = 1
    # One candidate: a calibration and a pretrain per cell would add minutes to each cycle
    # (docs/operations.md, "Candidates and the pre-screen": params.yaml builds all three).
    document["loop"]["candidates"] = ["incumbent_finetune"]
    out = DEMO_DIR / "params.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# written by `realloop demo` from params.yaml\n" + yaml.safe_dump(document))
    return out


# --- one-off steps, as a user runs them --------------------------------------------------------


def _realloop(*args: str, quiet: bool = True, niceness: int = 0) -> subprocess.CompletedProcess:
    """Runs a realloop command. Not quiet: its progress and its summary go to our stderr,
    since our stdout may be a --json document that its summary line would corrupt.
    `niceness` > 0: the command yields the CPU to everything else (background work that
    must not hold up the critical path, as the campaign's held-out evaluations)."""
    command = [sys.executable, "-m", "flows.cli", *args]
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} if quiet else {"stdout": 2}
    with subprocess.Popen(command, text=True, **output) as process:  # fd 2: our stderr
        if niceness:
            lower_priority(process.pid, niceness)
        stdout, errors = process.communicate()
    done = subprocess.CompletedProcess(command, process.returncode, stdout, errors)
    if done.returncode != 0:
        reason = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise CommandError(f"`realloop {' '.join(args[:2])}` failed: {reason[0]}")
    return done


def lower_priority(pid: int, by: int) -> None:
    """Make a started process `by` nicer than it is (it inherited ours; at most 19), from
    here: preexec_fn is not safe in a program with threads (the campaign runs its evaluations
    from a worker thread). Where the OS has no priorities (not POSIX) it runs as it is."""
    if hasattr(os, "setpriority"):
        niceness = os.getpriority(os.PRIO_PROCESS, pid)
        os.setpriority(os.PRIO_PROCESS, pid, min(niceness + by, 19))


def _ensure_sim_policy(params_path: Path, folder: str) -> None:
    """Pretrain as a DVC user does, `dvc repro pretrain`, so the policy is in DVC's cache and
    `dvc status` stays clean; with other params than the workspace's, `realloop cell pretrain`."""
    if (Path(folder) / "config.json").is_file():
        return
    stderr.print("demo: pretraining the sim policy (BC + DAgger in the randomized sim)")
    if Path(params_path).resolve() != Path("params.yaml").resolve():
        _realloop("cell", "pretrain", "--params", str(params_path), quiet=False)
        return
    # dvc.yaml's command is `realloop ...`: the venv this demo runs from comes first on PATH.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    command = [sys.executable, "-m", "dvc", "repro", "pretrain"]
    # stdout is the stage's --json summary; progress and errors are on stderr.
    done = subprocess.run(
        command, env=os.environ | {"PATH": path}, stdout=subprocess.DEVNULL, check=False
    )
    if done.returncode != 0:
        raise CommandError("`dvc repro pretrain` failed; its error is above")


def deploy_initial(params_path: Path, policy: str, cell: str) -> None:
    command = [sys.executable, "-m", "flows.cli", "deploy", "--initial", policy, "--cell", cell]
    command += ["--reason", "realloop demo: the sim policy is the first model", "--json"]
    done = subprocess.run(
        [*command, "--params", str(params_path)], capture_output=True, text=True, check=False
    )
    if done.returncode == 0:
        stderr.print(f"demo: {cell} runs the sim policy (initial deploy, recorded as an override)")
    elif "already has a production model" in done.stderr:
        stderr.print(f"demo: {cell} already has a production model")
    else:
        raise CommandError(f"deploy to {cell} failed: {done.stderr.strip().splitlines()[-1]}")


# --- the cells ---------------------------------------------------------------------------------


@contextmanager
def running_cells(fleet: Fleet, demo):
    with stopped_like_ctrl_c():  # a killed demo stops its cells too
        try:
            for index, cell in enumerate(fleet.cells):
                fleet.processes[cell] = start_cell(fleet, cell, demo, seed=1000 + index)
            yield fleet
        finally:
            stop_cells(fleet)


def start_cell(fleet: Fleet, cell: str, demo, seed: int) -> subprocess.Popen:
    box = DEMO_DIR / "boxes" / cell
    box.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "flows.cli", "cell", "run", "--cell-id", cell]
    command += ["--world", cell, "--channel", fleet.channel, "--landing", fleet.landing]
    command += ["--box", str(box), "--episodes-per-shift", str(demo.episodes_per_shift)]
    command += ["--speed", str(demo.speed), "--seed", str(seed), "--no-ground-truth"]
    command += ["--shifts", str(demo.shifts)]
    if fleet.root is not None:
        command += ["--root", str(fleet.root)]
    log = (DEMO_DIR / f"{cell}.log").open("a")
    stderr.print(f"demo: {cell} started (log: {DEMO_DIR / f'{cell}.log'})")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)


def stop_cells(fleet: Fleet) -> None:
    for process in fleet.processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + CELL_STOP_S
    for cell, process in fleet.processes.items():
        try:
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        stderr.print(f"demo: {cell} stopped (exit {code})")


def wait_for_shifts(fleet: Fleet, files: int, timeout_s: float) -> None:
    """Until the landing zone holds a whole shift (its `files` closed logs) from every cell."""
    from edge.channels import open_channel

    landing, deadline = open_channel(fleet.landing), time.monotonic() + timeout_s
    waiting = set(fleet.cells)
    with stderr.status("demo: waiting for each cell's first shift") as status:
        while waiting:
            keys = landing.list("")
            waiting = {c for c in waiting if sum(k.startswith(f"{c}_") for k in keys) < files}
            _check_alive(fleet)
            if time.monotonic() > deadline:
                raise CommandError(f"no shift log from {sorted(waiting)} in {timeout_s:.0f} s")
            status.update(f"demo: waiting for a shift from {', '.join(sorted(waiting))}")
            time.sleep(2.0)


def promoted_versions(cycles: list[dict]) -> dict[str, str]:
    """Per cell, the model version its last promotion published (`_run_cycles`' rows)."""
    from flows.cycle import PROMOTED

    return {
        row["cell"]: str(row["promoted_version"])
        for cycle in cycles
        for row in cycle["cells"]
        if row["outcome"] == PROMOTED
    }


def wait_for_boxes(versions: dict[str, str], timeout_s: float) -> None:
    """Keep the cells running until each box has activated the version published for it, so
    the report shows what the boxes run after the demo, not before its last promotion."""
    deadline = time.monotonic() + timeout_s
    with stderr.status("demo: waiting for the boxes to take their releases"):
        while versions and time.monotonic() < deadline:
            versions = {
                cell: version
                for cell, version in versions.items()
                if str(box_status(cell).get("model_version")) != version
            }
            if versions:
                time.sleep(1.0)
    for cell, version in versions.items():
        stderr.print(f"demo: {cell}'s box has not taken version {version} in {timeout_s:.0f} s")


def _check_alive(fleet: Fleet) -> None:
    for cell, process in fleet.processes.items():
        if process.poll() is not None:
            raise CommandError(f"cell {cell} exited ({process.returncode}); see its log")


# --- the loop ----------------------------------------------------------------------------------


def _run_cycles(params_path: Path, fleet: Fleet, max_cycles: int, as_json: bool) -> list[dict]:
    """Loop cycles for the cells not yet promoted, at most max_cycles of them."""
    from flows.commands import _workspace
    from flows.cycle import PROMOTED, print_cycle
    from flows.loop import loop_flow

    workspace, cycles, pending = _workspace(), [], list(fleet.cells)
    for _ in range(max_cycles):
        for cell in pending if len(pending) < len(fleet.cells) else [None]:
            summary = loop_flow(
                params_path=str(params_path),
                workspace=str(workspace),
                cell=cell,
                source=fleet.source,
                progress=not as_json,
            )
            cycles.append(summary)
            if not as_json:
                print_cycle(summary, stdout.print)
        promoted = {c["cell"] for s in cycles for c in s["cells"] if c["outcome"] == PROMOTED}
        pending = [cell for cell in fleet.cells if cell not in promoted]
        if not pending:
            break
    return [_cycle_rows(summary) for summary in cycles]


def _keys_folder(params) -> Path:
    from pipelines.release import keys_location

    return keys_location(params.promote.keys, Path.cwd())


def box_status(cell: str) -> dict:
    """What the cell's edge box runs: `realloop-edge status`, or why it cannot say."""
    from edge.agent import status
    from edge.errors import EdgeError

    try:
        return status(DEMO_DIR / "boxes" / cell)
    except EdgeError as exc:
        return {"error": str(exc)}


def box_line(box: dict) -> str:
    if "error" in box:
        return box["error"]
    decision = box.get("decision") or {}
    attested = decision.get("attestation") or {}
    if attested:
        rates = {arm: _percent(rate) for arm, rate in (attested.get("success_rates") or {}).items()}
        why = (
            f"gate attestation: verdict {attested.get('verdict')} on trial request "
            f"{attested.get('request_id')} (candidate {rates.get('candidate')}, incumbent "
            f"{rates.get('incumbent')})"
        )
    else:
        why = f"{decision.get('kind')} by {decision.get('by')}: {decision.get('reason')}"
    return (
        f"model version {box.get('model_version')}, {why}, signed: "
        f"{str(box.get('signed')).lower()}, intact: {str(box.get('intact')).lower()}"
    )


def _percent(rate) -> str:
    return f"{rate:.0%}" if isinstance(rate, int | float) else str(rate)


def _cycle_rows(summary: dict) -> dict:
    rows = []
    for cell in summary["cells"]:
        trials = cell.get("trials") or {}
        rows.append(
            {
                "cell": cell["cell"],
                "dataset_version": cell.get("dataset_version"),
                "candidate": trials.get("candidate"),
                "incumbent": trials.get("incumbent"),
                "gate_passed": None if cell.get("gate") is None else cell["gate"]["passed"],
                "outcome": cell["outcome"],
                "promoted_version": cell.get("promoted_version"),
            }
        )
    return {"cycle": summary["cycle"], "cells": rows, "dvc": summary.get("dvc")}


def _print_report(report: dict) -> None:
    from rich.table import Table

    from flows.cycle import format_trials

    table = Table(title="realloop demo: one row per cycle and cell")
    for column in ("cycle", "cell", "dataset", "candidate", "incumbent", "gate", "result"):
        table.add_column(column)
    for cycle in report["cycles"]:
        for row in cycle["cells"]:
            gate = {None: "-", True: "PASSED", False: "FAILED"}[row["gate_passed"]]
            result = row["outcome"]
            if row["promoted_version"] is not None:
                result = f"promoted version {row['promoted_version']}"
            table.add_row(
                str(cycle["cycle"]),
                row["cell"],
                (row["dataset_version"] or "-")[:12],
                format_trials(row["candidate"]),
                format_trials(row["incumbent"]),
                gate,
                result,
            )
    stdout.print(table)
    for cell, box in report.get("boxes", {}).items():
        stdout.print(f"{cell} edge box: {box_line(box)}", highlight=False, soft_wrap=True)
    stdout.print(f"demo finished in {report['wall_s'] / 60:.1f} min")
    commits = [c["dvc"]["commit"][:10] for c in report["cycles"] if (c["dvc"] or {}).get("commit")]
    if commits:  # each cycle's stages, metrics and plots, committed (dvc.yaml)
        stdout.print(
            f"cycles in git: {', '.join(commits)} (tags cycle-<n>); compare them with "
            "`dvc exp show --all-tags`, `dvc metrics show`, `dvc plots show`"
        )
