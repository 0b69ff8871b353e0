"""The cycle's artifacts are laid out from the rows the terminal prints; links and keys.
(That flows publish them, and what a real cycle's say, is checked in test_loop.py and
test_ingest_flow.py, read back through the Prefect client.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flows import artifacts, cycle


def stats(successes: int) -> dict:
    return {"n": 10, "successes": successes, "success_rate": successes / 10, "interval": [0.5, 1]}


def summary(params) -> dict:
    promoted = {
        "plan": {"skip": None, "model_version": "3"},
        "trained": {"model_version": "4", "mlflow_run_id": "r1"},
        "waited": {"state": "complete", "reason": None, "attempt": None, "waited_s": 12.0},
        "gate": {"passed": True, "reasons": ["pass: a"], "candidate": stats(9)}
        | {"incumbent": stats(5)},
        "promotion": {"promoted": True, "reasons": ["pass: a", "promoted: version 4"]},
    }
    late = {"plan": {"skip": None}, "waited": {"state": "timed out", "reason": "late | slow"}}
    cells = [
        cycle.cell_result("cell-07", "abcdef0123456789", promoted),
        cycle.cell_result("cell-09", "abcdef0123456789", late),
    ]
    ingest = {"episodes_ingested": 4, "files_ingested": 2, "files_quarantined": 0}
    ingested = {"dataset_version": "abcdef0123456789", "ingest": ingest | {"quarantined": []}}
    validation = {
        "passed": 2,
        "batches": 2,
        "excluded_from_training": [],
        "data_docs": "data/validation/abc/index.html",
    }
    now = datetime.now(UTC)
    return cycle.summarize_cycle(params, 5, now, now, [ingested], validation, cells, {})


def test_the_cycle_summary_has_the_terminals_rows_with_links(params, tmp_path):
    from rich.console import Console

    cycle_summary = summary(params)
    runs = {"cell-07": artifacts.mlflow_run_link(tmp_path, "r1")}
    text = artifacts.cycle_markdown(cycle_summary, runs)

    console = Console(width=200, record=True)
    cycle.print_cycle(cycle_summary, console.print)
    printed = console.export_text()
    for row in cycle.cell_rows(cycle_summary):
        assert all(value in printed for value in row.values())
        assert "| " + " | ".join(row.values()) + " | " in text  # the same cells, same order
    assert "| cell-07 | abcdef012345 | 9/10 90% (50%–100%) | 5/10 50% (50%–100%) | PASSED" in text
    assert "| promoted version 4 | `MLflow run r1 in sqlite:///" in text
    assert "| cell-09 | abcdef012345 | - | - | - | trials incomplete | - |" in text
    assert "- cell-07 gate: pass: a" in text and "- cell-09 trials incomplete: late | slow" in text
    assert "[Data Docs data/validation/abc/index.html](file:///" in text


def test_keys_are_what_prefect_accepts():
    assert artifacts.key("Cell_07", "gate") == "cell-07-gate"
    assert artifacts.key("cell-07", "mlflow-run") == "cell-07-mlflow-run"


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a free loopback port, as a team would run it (about a minute to
    start on a loaded machine, hence slow)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mlflow = Path(sys.executable).with_name("mlflow")
    stores = ["--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    stores += ["--default-artifact-root", str(tmp_path / "artifacts")]
    server = subprocess.Popen(
        [
            str(mlflow),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            *stores,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its workers go down with it
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_mlflow_server_run_is_linked_to_its_page(mlflow_server, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    client = MlflowClient(mlflow_server)
    experiment = client.create_experiment("link-check")
    run_id = client.create_run(experiment).info.run_id
    link = artifacts.mlflow_run_link(tmp_path, run_id)
    assert link["url"] == f"{mlflow_server}/#/experiments/{experiment}/runs/{run_id}"
    assert urllib.request.urlopen(link["url"].split("#")[0]).status == 200  # the UI serves it
