"""Screenshots of what a reviewer opens after a loop: MLflow, Prefect and the Data Docs.

    .venv/bin/python docs/screenshots/take.py --workspace WS [--out docs/screenshots]

WS is a workspace after `realloop demo` (or any loop). The script serves its stores the way
their users would, each on loopback: `mlflow server` on WS/mlflow.db, `prefect server start`
with PREFECT_HOME=WS/.prefect (where the embedded runs were recorded), then drives Debian's
headless Chromium (`apt-get install chromium`) over the pages and writes one PNG per page.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

import yaml

BIN = Path(sys.executable).parent
WINDOW = "1500,1000"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    workspace, out = args.workspace.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as servers:
        mlflow_url = servers.enter_context(_mlflow_server(workspace))
        prefect_url = servers.enter_context(_prefect_server(workspace))
        train = yaml.safe_load((workspace / "params.yaml").read_text())["train"]
        pages = {
            **_mlflow_pages(mlflow_url, train["experiment"], train["registered_model"]),
            **_prefect_pages(prefect_url),
            **_data_docs_pages(workspace),
        }
        for name, url in pages.items():
            _screenshot(url, out / f"{name}.png")
            print(f"{name}: {url}")


def _mlflow_pages(url: str, experiment_name: str, model: str) -> dict[str, str]:
    name = urllib.parse.quote(experiment_name)
    experiment = _get_json(f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name={name}")
    experiment_id = experiment["experiment"]["experiment_id"]
    runs = _post_json(
        f"{url}/api/2.0/mlflow/runs/search",
        {
            "experiment_ids": [experiment_id],
            "filter": "attributes.run_name LIKE 'finetune%'",
            "order_by": ["start_time DESC"],
            "max_results": 1,
        },
    )["runs"]
    run = runs[0]["info"]
    parent = next(
        (
            tag["value"]
            for tag in runs[0]["data"].get("tags", [])
            if tag["key"] == "mlflow.parentRunId"
        ),
        run["run_id"],
    )
    versions = _get_json(f"{url}/api/2.0/mlflow/registered-models/get?name={model}")[
        "registered_model"
    ]["latest_versions"]
    version = max(int(v["version"]) for v in versions)
    order = urllib.parse.quote("metrics.`trial/candidate_success`")
    return {
        "mlflow-experiment": f"{url}/#/experiments/{experiment_id}/runs?orderByKey={order}"
        "&orderByAsc=false",
        "mlflow-run": f"{url}/#/experiments/{experiment_id}/runs/{parent}",
        "mlflow-finetune-run": f"{url}/#/experiments/{experiment_id}/runs/{run['run_id']}",
        "mlflow-model-version": f"{url}/#/models/{model}/versions/{version}",
    }


def _prefect_pages(url: str) -> dict[str, str]:
    runs = _post_json(
        f"{url}/api/flow_runs/filter",
        {"flow_runs": {"name": {}}, "sort": "START_TIME_DESC", "limit": 50},
    )
    loop = next(
        r
        for r in runs
        if r.get("state_type") == "COMPLETED" and _flow_name(url, r) == "retrain-loop"
    )
    return {"prefect-flow-run": f"{url}/runs/flow-run/{loop['id']}?tab=Artifacts"}


def _flow_name(url: str, run: dict) -> str:
    return _get_json(f"{url}/api/flows/{run['flow_id']}")["name"]


def _data_docs_pages(workspace: Path) -> dict[str, str]:
    indexes = sorted(workspace.glob("data/validation/**/index.html"), key=os.path.getmtime)
    if not indexes:
        return {}
    index = indexes[-1]
    failing = next(
        (
            p
            for p in sorted(index.parent.rglob("*.html"))
            if "fail" in p.read_text(errors="ignore").lower() and p != index
        ),
        None,
    )
    pages = {"data-docs-index": index.as_uri()}
    if failing is not None:
        pages["data-docs-failing-suite"] = failing.as_uri()
    return pages


def _screenshot(url: str, path: Path) -> None:
    subprocess.run(
        [
            "chromium",
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={WINDOW}",
            "--virtual-time-budget=20000",
            f"--screenshot={path}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )


@contextmanager
def _mlflow_server(workspace: Path):
    port = _free_port()
    command = [
        str(BIN / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{workspace / 'mlflow.db'}",
        "--workers",
        "1",
    ]
    with _serving(command, f"http://127.0.0.1:{port}", "/health", workspace) as url:
        yield url


@contextmanager
def _prefect_server(workspace: Path):
    port = _free_port()
    env = {
        "PREFECT_HOME": str(workspace / ".prefect"),
        "PREFECT_API_URL": "",
        # The UI's own calls go to this URL (default: port 4200, which may be another server).
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_API_PORT": str(port),
    }
    command = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with _serving(command, f"http://127.0.0.1:{port}", "/api/health", workspace, env) as url:
        yield url


@contextmanager
def _serving(command, url, health, cwd, env=None):
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + health, timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise SystemExit(f"{command[0]}: did not start on {url}") from None
                time.sleep(1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def _post_json(url: str, body: dict):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


if __name__ == "__main__":
    main()
