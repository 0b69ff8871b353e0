"""One loop at a time per cell (flows/loop_lock.py): quick checks, no server. The fault suite
(tests/faults/test_two_loops.py) starts two real loops at once against the production profile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta

import pytest

from flows import loop_lock, waiting
from flows.console import CommandError
from pipelines.ingest import versioning
from tests.conftest import ROOT, realloop


def free(workspace, cells, params) -> None:
    """Take the cells' locks and let go: raises CommandError when another loop holds one."""
    with loop_lock.cells_locked(workspace, cells, None, params):
        pass


@pytest.fixture
def workspace(tmp_path):
    versioning.ensure_workspace(tmp_path, ".realloop/dvc-remote")
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (tmp_path / "data" / "landing").mkdir(parents=True)
    return tmp_path


def test_a_second_loop_for_a_held_cell_refuses_in_one_line_before_ingesting(workspace, params):
    with loop_lock.cells_locked(workspace, ["cell-07", "cell-08"], "run-a", params):
        done = realloop("loop", "--cell", "cell-07", cwd=workspace)
        free(workspace, ["cell-09"], params)  # another cell is free
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("realloop: cell-07: another loop is running for this cell")
    assert f"pid {os.getpid()}, flow run run-a" in line and "loop-cell-07.lock" in line
    assert not (workspace / "data" / "dataset").exists()  # refused before ingest
    assert not (workspace / ".realloop" / "cycles.jsonl").exists()
    with loop_lock.cells_locked(workspace, ["cell-07"], "run-b", params):
        pass  # released when the first one ended


def test_a_loop_that_dies_releases_its_cells(workspace, params):
    hold = (
        "import sys, time; from pathlib import Path; from flows import loop_lock; "
        "from pipelines.contract.params import load_params; "
        "p = load_params(Path(sys.argv[1]) / 'params.yaml'); "
        "cm = loop_lock.cells_locked(Path(sys.argv[1]), ['cell-07'], 'dying', p); "
        "cm.__enter__(); print('held', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", hold, str(workspace)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(CommandError, match="flow run dying"):
            free(workspace, ["cell-07"], params)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    free(workspace, ["cell-07"], params)  # no stale lock after a crash


def test_a_loop_suspended_for_its_trials_holds_its_cell_but_not_against_itself(workspace, params):
    deadline = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    requests = {"cell-07": {"request_id": "r1", "deadline": deadline}}
    waiting.save(workspace, "run-suspended", requests, {})
    with pytest.raises(CommandError, match="run-suspended is suspended waiting"):
        free(workspace, ["cell-07"], params)
    with loop_lock.cells_locked(workspace, ["cell-07"], "run-suspended", params):
        pass  # the same run, resumed
    free(workspace, ["cell-08"], params)
    record = json.loads((workspace / ".realloop" / "locks" / "loop-cell-07.lock").read_text())
    assert record["flow_run"] == "run-suspended"


def test_the_command_lines_lock_is_the_flows_in_its_thread_and_no_other(workspace, params):
    """`realloop loop` takes the lock, then its flow (same thread) takes it again: no refusal
    of itself, and the flow's run id is recorded. A loop in another thread is refused, also
    after the flow ended while the command line still holds it."""
    refused = []

    def other_loop() -> None:
        try:
            free(workspace, ["cell-07"], params)
        except CommandError as exc:
            refused.append(str(exc))

    with loop_lock.cells_locked(workspace, ["cell-07"], None, params):
        with loop_lock.cells_locked(workspace, ["cell-07"], "run-flow", params):
            _in_thread(other_loop)
        _in_thread(other_loop)
    assert len(refused) == 2 and "flow run run-flow" in refused[0], refused
    free(workspace, ["cell-07"], params)


def _in_thread(target) -> None:
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
