"""The deployment shape end to end: three reference cells as processes and `realloop loop`,
meeting only through an S3-compatible server on loopback (landing zone and edge channel).

- every cell gets one gated promotion, and every trial episode is attributed to its request,
  attempt and arm (its logs name the bundle the arm ran);
- cell-08 is SIGKILLed in the middle of its trial and restarted: the cycle still completes,
  judged on one whole attempt, never a partial one;
- cell-09 then stops uploading (frozen): its next cycle ends "trials incomplete" within the
  timeout and its request is withdrawn from the channel.

The first model is a barely trained policy and the cells are lenient (tests/flows/test_loop),
so a candidate fine-tuned on the cells' own shifts passes the gate. All three run the `line`
world: what is under test is the protocol between processes, not how hard each line is (a
6-episode trial on cell-07's laggier line is too small to promote reliably).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from edge.channels import open_channel
from edge.trials import open_requests, read_history
from pipelines.ingest import read_dataset
from tests.conftest import ROOT, realloop
from tests.flows.test_loop import small_params

# Three cell processes and two loops: about 3 minutes on 2 cores, so `make test-all` runs it.
pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

CELLS = ("cell-07", "cell-08", "cell-09")
KILLED, FROZEN = "cell-08", "cell-09"
# Per arm: a candidate that succeeds a third of the time fails all 10 in 1.7% of runs.
EPISODES_PER_ARM = 10
SHIFT = 30  # production episodes per cell: what the candidates learn from


def test_three_cell_processes_and_the_loop_meet_only_through_s3(tmp_path, s3_bucket, s3_env):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    stores = {"channel": f"s3://{s3_bucket}/channel", "landing": f"s3://{s3_bucket}/landing"}
    params = fleet_params(workspace, stores["channel"], timeout_s=300)
    first_model = deploy_a_first_model(workspace, params)
    cells = {cell: start_cell(tmp_path, cell, stores, params) for cell in CELLS}
    try:
        landed = lambda: min(landed_files(stores["landing"]).values())  # noqa: E731
        wait_for(lambda: landed() >= SHIFT // 10, "a shift from each cell")
        loop = start_loop(workspace, params, stores["landing"])
        cells[KILLED] = kill_mid_trial_and_restart(tmp_path, cells[KILLED], stores, params)
        summary = finish(loop)
        outcomes = {c["cell"]: c["outcome"] for c in summary["cells"]}
        assert outcomes == {cell: "promoted" for cell in CELLS}, summary["cells"]
        check_trials_attributed(workspace, summary, first_model)

        cells[FROZEN].send_signal(signal.SIGSTOP)  # alive, but uploads nothing any more
        short = fleet_params(workspace, stores["channel"], timeout_s=20, name="short.yaml")
        started = time.monotonic()
        frozen = finish(start_loop(workspace, short, stores["landing"], cell=FROZEN))
        assert [c["outcome"] for c in frozen["cells"]] == ["trials incomplete"]
        assert time.monotonic() - started < 240
        channel = open_channel(stores["channel"])
        assert open_requests(channel, FROZEN) == []
        assert [e["action"] for e in read_history(channel, FROZEN)][-1] == "trial_withdrawn"
        cells[FROZEN].send_signal(signal.SIGCONT)
    finally:
        codes = stop_cells(cells)
    assert codes == {cell: 0 for cell in CELLS}


# --- the workspace ---------------------------------------------------------------------------


def fleet_params(workspace: Path, channel: str, timeout_s: int, name="params.yaml") -> Path:
    path = small_params(workspace)
    params = yaml.safe_load(path.read_text())
    params["fleet"]["cells"] = list(CELLS)
    params["promote"]["channel"] = channel
    params["trials"].update(max_episodes=EPISODES_PER_ARM, timeout_s=timeout_s, poll_s=2)
    target = workspace / name
    target.write_text(yaml.safe_dump(params))
    return target


def deploy_a_first_model(workspace: Path, params: Path) -> str:
    policy = workspace / "models" / "first"
    done = realloop(
        "cell", "pretrain", "--params", str(params), "--out", str(policy), cwd=workspace
    )
    assert done.returncode == 0, done.stderr
    for cell in CELLS:
        done = realloop(
            *("deploy", "--initial", str(policy), "--cell", cell, "--params", str(params)),
            cwd=workspace,
        )
        assert done.returncode == 0, done.stderr
    return str(policy)


# --- cells and loop as processes -------------------------------------------------------------


def start_cell(tmp_path: Path, cell: str, stores: dict, params: Path) -> subprocess.Popen:
    # One shift each, then only trials: the loop gets the cores. The killed cell runs slower,
    # so that its trial lasts long enough to be cut.
    speed = "10" if cell == KILLED else "100"
    command = [
        *("cell", "run", "--cell-id", cell, "--world", "line", "--box", str(tmp_path / cell)),
        *("--channel", stores["channel"], "--landing", stores["landing"], "--poll-s", "0.5"),
        *(
            "--episodes-per-shift",
            str(SHIFT),
            "--speed",
            speed,
            "--seed",
            str(len(cell)),
            "--params",
        ),
        *(str(params), "--no-ground-truth", "--shifts", "1"),
    ]
    log = (tmp_path / f"{cell}.log").open("a")
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *command], cwd=ROOT, stdout=log, stderr=log
    )


def start_loop(workspace: Path, params: Path, landing: str, cell: str | None = None):
    command = [sys.executable, "-m", "flows.cli", "loop", "--json", "--source", landing]
    command += ["--params", str(params), *(["--cell", cell] if cell else [])]
    return subprocess.Popen(command, cwd=workspace, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(loop: subprocess.Popen) -> dict:
    out, err = loop.communicate(timeout=900)
    assert loop.returncode == 0, err.decode()[-3000:]
    assert b"Traceback" not in err
    return json.loads(out)


def kill_mid_trial_and_restart(tmp_path: Path, cell: subprocess.Popen, stores, params):
    attempts = tmp_path / KILLED / "trials"
    wait_for(lambda: any(attempts.glob("*/*/")), "cell-08 to start a trial attempt")
    cell.send_signal(signal.SIGKILL)
    cell.wait()
    assert not list(attempts.glob("*.done"))  # killed before the attempt was whole
    return start_cell(tmp_path, KILLED, stores, params)


def stop_cells(cells: dict[str, subprocess.Popen]) -> dict[str, int]:
    for process in cells.values():
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
    codes = {}
    for cell, process in cells.items():
        try:
            codes[cell] = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            codes[cell] = "killed"
    return codes


def wait_for(condition, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1.0)


def landed_files(landing: str) -> dict[str, int]:
    keys = [k for k in open_channel(landing).list("") if k.endswith(".mcap") and "/" not in k]
    return {cell: sum(k.startswith(f"{cell}_") for k in keys) for cell in CELLS}


# --- what the gate judged ----------------------------------------------------------------------


def check_trials_attributed(workspace: Path, summary: dict, first_model: str) -> None:
    episodes = read_dataset(workspace / "data" / "dataset")[0].to_pylist()
    for cell in summary["cells"]:
        asked, attempt = cell["trial_request"], cell["attempt"]
        request = [e for e in episodes if e["trial_request_id"] == asked["request_id"]]
        judged = [e for e in request if e["trial_attempt"] == attempt["attempt"]]
        for arm in ("candidate", "incumbent"):
            rows = [e for e in judged if e["trial_arm"] == arm]
            assert len(rows) == EPISODES_PER_ARM == len(attempt["episodes"][arm])
            assert {e["episode_id"] for e in rows} == set(attempt["episodes"][arm])
            assert {e["cell_id"] for e in rows} == {cell["cell"]}
            assert {e["policy_version"] for e in rows} == {asked["arms"][arm]["bundle_id"]}
        # Every trial episode that landed belongs to a whole attempt: nothing partial uploaded.
        for attempt in {e["trial_attempt"] for e in request}:
            arms = [e["trial_arm"] for e in request if e["trial_attempt"] == attempt]
            assert sorted(arms) == sorted(["candidate", "incumbent"] * EPISODES_PER_ARM)
