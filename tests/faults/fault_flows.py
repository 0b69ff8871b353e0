"""The flows the fault suite deploys on the profile's work pool (from this file, copied into the
profile's workspace; run by the workers, never imported by the tests themselves).

`steps` stands for a long flow of realloop's: `steps` tasks of `pause_s` each, every one
leaving a line in <out>/steps.log (a landing file per step: a duplicate would show) and a
metric in MLflow (the tracking server on Postgres), then <out>/done.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prefect import flow, runtime, task


@task(name="step", task_run_name="step {index}")
def step(out: str, index: int, pause_s: float, run_id: str) -> None:
    import mlflow

    time.sleep(pause_s)
    mlflow.MlflowClient().log_metric(run_id, "step", index, step=index)
    line = {"step": index, "flow_run": str(runtime.flow_run.id), "pid": os.getpid()}
    with open(Path(out) / "steps.log", "a") as log:
        log.write(json.dumps(line) + "\n")


@flow(name="fault-steps")
def steps(out: str, steps: int = 10, pause_s: float = 2.0) -> int:
    import mlflow

    client = mlflow.MlflowClient()
    found = client.get_experiment_by_name("fault-steps")
    experiment = found.experiment_id if found else client.create_experiment("fault-steps")
    run = client.create_run(experiment, tags={"flow_run_id": str(runtime.flow_run.id)})
    for index in range(steps):
        step(out, index, pause_s, run.info.run_id)
    client.set_terminated(run.info.run_id)
    (Path(out) / "done").write_text(run.info.run_id)
    return steps
