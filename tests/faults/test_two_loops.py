"""Fault: two loops for the same cell started at once.

Two `realloop loop --cell cell-07` processes are started together against the production
profile (a scheduled run and one started by hand, two operators, two `realloop serve`s). One
takes the cell's loop lock (flows/loop_lock.py) and runs its cycle: ingest, validate, fine-tune,
a trial request that no cell answers (the cycle ends "trials incomplete" at its deadline); the
other refuses at once, in one line naming the holder, before it ingests anything. History
stays consistent: one cycle in the ledger, one dataset version, one fine-tune run and one
candidate version in the registry, one trial request, and the channel's signed releases as
they were.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from edge.channels import open_channel
from edge.release import current_release
from edge.trials import open_requests, read_history
from flows import loop_lock
from pipelines.contract.params import load_params
from pipelines.ingest import versioning
from tests.flows.test_deployments import loop_workspace

pytestmark = [pytest.mark.faults, pytest.mark.timeout(1200)]
CELL, TIMEOUT_S = "cell-07", 20


def test_two_loops_at_once_one_runs_one_refuses_and_the_history_stays_consistent(
    in_profile, tmp_path
):
    from mlflow import MlflowClient

    workspace = loop_workspace(tmp_path)
    params_path = workspace / "params.yaml"
    raw = yaml.safe_load(params_path.read_text())
    raw["trials"].update(timeout_s=TIMEOUT_S, poll_s=3)
    params_path.write_text(yaml.safe_dump(raw))
    params = load_params(params_path)
    client = MlflowClient(in_profile.url("mlflow"))
    model = params.train.registered_model
    before = {v.version for v in client.search_model_versions(f"name = '{model}'")}
    channel_uri = str(workspace / params.promote.channel)
    channel = open_channel(channel_uri)
    released = current_release(channel_uri, CELL)  # the cell's signed release now

    command = [sys.executable, "-m", "flows.cli", "loop", "--cell", CELL, "--json"]
    started = time.monotonic()
    loops = [
        subprocess.Popen(command, cwd=workspace, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    done = [(p.wait(timeout=900), *(s.decode() for s in p.communicate())) for p in loops]
    took = time.monotonic() - started

    assert sorted(rc for rc, _, _ in done) == [0, 1], [(rc, err[-800:]) for rc, _, err in done]
    (ran,) = [d for d in done if d[0] == 0]
    (refused,) = [d for d in done if d[0] == 1]
    (last,) = refused[2].strip().splitlines()  # one line: refused before any flow run
    assert last.startswith(f"realloop: {CELL}: another loop is running for this cell"), refused[2]
    summary = json.loads(ran[1])
    (cell,) = summary["cells"]
    assert cell["outcome"] == "trials incomplete", cell

    ledger = (workspace / ".realloop" / "cycles.jsonl").read_text().splitlines()
    assert len(ledger) == 1 and json.loads(ledger[0])["cycle"] == 0
    versions = versioning.list_versions(workspace)
    assert [v.version for v in versions] == [summary["dataset_version"]]
    runs = client.search_runs(
        [client.get_experiment_by_name(params.train.experiment).experiment_id],
        f"tags.`realloop.stage` = 'finetune' and tags.cell_id = '{CELL}' "
        f"and tags.dataset_version = '{summary['dataset_version']}'",
    )
    assert len(runs) == 1, [r.info.run_id for r in runs]
    after = {v.version for v in client.search_model_versions(f"name = '{model}'")}
    assert after - before == {cell["training"]["model_version"]}, (before, after)
    requests = [e for e in read_history(channel, CELL) if e["action"] == "trial_requested"]
    assert len(requests) == 1 and open_requests(channel, CELL) == []
    assert current_release(channel_uri, CELL) == released  # trials came and went, no release
    with loop_lock.cells_locked(workspace, [CELL], None, params):
        pass  # released at the end of the cycle
    print(f"two loops at once: {took:.0f} s; refused with: {last}")
