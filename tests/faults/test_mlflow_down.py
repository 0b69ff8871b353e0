"""Fault: the MLflow tracking server is down for 30 s in the middle of training.

The server process is killed (SIGKILL, as a crash or an OOM kill does it) after the run's
first ten epochs were logged, and `realloop services up` restarts it 30 s later. Training goes
on meanwhile (the policy never waits for tracking); the next flush of epoch metrics meets a
closed port and MLflow's client retries it with backoff (MLFLOW_HTTP_REQUEST_MAX_RETRIES, 7
by default: more than a minute) until the server is back, so the run resumes: every epoch
recorded once, the learning curve and the registered version as without the fault. The next
training run is unaffected.
"""

from __future__ import annotations

import threading
import time

import pytest

from flows import services as sv
from tests.faults.conftest import EPOCHS, bring_back, train_and_register

pytestmark = pytest.mark.faults
DOWN_S = 30.0
CELL = "cell-32"  # its own cell: the tests share the profile's registry


def test_a_training_run_resumes_across_a_30_s_mlflow_outage_and_the_next_is_unaffected(
    in_profile, params, tmp_path
):
    from mlflow import MlflowClient

    profile, workspace = in_profile, tmp_path / "workspace"
    outage: dict[str, float] = {}

    def kill_after_tenth_epoch(epoch: int) -> None:
        if epoch == 10:  # epochs 0-9 are on the server: the first flush
            assert sv.terminate(profile, "mlflow", grace_s=0)
            outage["down"] = time.monotonic()
            threading.Thread(target=_back_after, args=(profile, outage), daemon=True).start()

    started = time.monotonic()
    run_id, version, _ = train_and_register(
        params, workspace, CELL, seed=3, after_epoch=kill_after_tenth_epoch
    )
    took = time.monotonic() - started
    assert outage.get("back_s") is not None, "the server was not brought back"
    assert took >= DOWN_S  # the run waited for the server, it did not skip the outage

    client = MlflowClient(profile.url("mlflow"))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for name in ("train_loss", "val_loss"):
        steps = [m.step for m in client.get_metric_history(run_id, name)]
        assert sorted(steps) == list(range(EPOCHS)), (name, steps)  # each epoch once
    assert "learning_curve.png" in {a.path for a in client.list_artifacts(run_id)}
    model = params.train.registered_model
    from_run = client.search_model_versions(f"name = '{model}' and run_id = '{run_id}'")
    assert [v.version for v in from_run] == [version]  # registered once, not twice

    # The next run (the next cycle's training) meets no trace of the outage.
    started = time.monotonic()
    next_run, _, _ = train_and_register(params, workspace, CELL, seed=4)
    next_s = time.monotonic() - started
    assert client.get_run(next_run).info.status == "FINISHED"
    assert next_s < DOWN_S
    print(
        f"training across the outage {took:.1f} s, server back in {outage['back_s']:.1f} s "
        f"after the restart began, next run {next_s:.1f} s"
    )


def _back_after(profile: sv.Profile, outage: dict[str, float]) -> None:
    time.sleep(max(0.0, outage["down"] + DOWN_S - time.monotonic()))
    outage["back_s"] = bring_back(profile)
