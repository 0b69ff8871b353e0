"""A screenshot of the sign-off form (flows/approval.py) as a reviewer sees it in the Prefect UI.

    .venv/bin/python docs/screenshots/take_sign_off.py [--out docs/screenshots]

Starts `prefect server start` (UI on) on loopback with a throwaway PREFECT_HOME, runs a flow in
a child process that pauses with the sign-off form for a made-up gate record, then drives
Debian's headless Chromium over the DevTools protocol: opens the paused run, presses Resume
and captures the form (`prefect-sign-off.png`). Nothing is promoted: the flow only asks.
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from take import _free_port, _get_json, _serving  # the sibling script's helpers

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
PAUSING = """
import dataclasses, sys
from prefect import flow
from flows import approval
from pipelines.contract.params import load_params
GATE = {"passed": True, "trial_request_id": "req-20261203-cell-07-5", "stopped": "efficacy",
        "candidate": {"successes": 56, "n": 60, "success_rate": 0.933, "interval": [0.86, 0.97]},
        "incumbent": {"successes": 46, "n": 60, "success_rate": 0.767, "interval": [0.67, 0.84]},
        "reasons": ["pass: no worse than the incumbent by more than 0.020 after 60 episodes per "
                    "arm: score 2.81 >= boundary 2.30 (alpha 0.05)",
                    "pass: 0 safety stops (0 allowed)",
                    "pass: p95 cycle time 4.00 s <= budget 5.50 s"]}
@flow(name="retrain-loop")
def loop():
    params = load_params(sys.argv[1])
    promote = dataclasses.replace(params.promote, approval_timeout_s=600)
    approval.ask(dataclasses.replace(params, promote=promote), "cell-07", {"model_version": "5"},
                 GATE)
loop()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    out = parser.parse_args().out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="realloop-sign-off-") as tmp:
        port = _free_port()
        api = f"http://127.0.0.1:{port}/api"
        env = {"PREFECT_HOME": tmp, "PREFECT_API_URL": "", "PREFECT_UI_API_URL": api}
        command = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1"]
        with _serving([*command, "--port", str(port)], api[:-4], "/api/health", tmp, env) as url:
            child = subprocess.Popen(
                [sys.executable, "-c", PAUSING, str(ROOT / "params.yaml")],
                cwd=ROOT,
                env={**_clean_env(), "PREFECT_API_URL": api, "PREFECT_HOME": tmp},
            )
            try:
                run_id = _paused_run(api)
                _capture(f"{url}/runs/flow-run/{run_id}", out / "prefect-sign-off.png")
            finally:
                child.kill()
    print(out / "prefect-sign-off.png")


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}


def _paused_run(api: str) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            f"{api}/flow_runs/filter",
            data=json.dumps({"flow_runs": {"state": {"type": {"any_": ["PAUSED"]}}}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            runs = json.load(response)
        if runs:
            time.sleep(2)  # the form's schema is saved right after the pause
            return runs[0]["id"]
        time.sleep(1)
    raise SystemExit("no paused flow run within 120 s")


def _capture(page: str, path: Path) -> None:
    """Chromium over DevTools: open the run, press Resume, screenshot the form."""
    from websockets.sync.client import connect

    port = _free_port()
    browser = subprocess.Popen(
        [
            "chromium",
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1500,1000",
            f"--remote-debugging-port={port}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        target = _devtools_page(port)
        with connect(target, max_size=None) as ws:
            calls = iter(range(1, 1000))

            def call(method: str, **params):
                number = next(calls)
                ws.send(json.dumps({"id": number, "method": method, "params": params}))
                while True:
                    message = json.loads(ws.recv())
                    if message.get("id") == number:
                        return message.get("result", {})

            call("Page.navigate", url=page)
            time.sleep(8)  # the UI loads the run and its state
            clicked = call(
                "Runtime.evaluate",
                expression=(
                    "(() => { const b = [...document.querySelectorAll('button')]"
                    ".find(b => b.textContent.trim() === 'Resume');"
                    " if (b) b.click(); return !!b; })()"
                ),
                returnByValue=True,
            )
            if not clicked.get("result", {}).get("value"):
                raise SystemExit(f"{page}: no Resume button on the page")
            time.sleep(4)  # the modal loads the form's schema and description
            shot = call("Page.captureScreenshot", format="png")
            path.write_bytes(base64.b64decode(shot["data"]))
    finally:
        browser.kill()


def _devtools_page(port: int) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            pages = _get_json(f"http://127.0.0.1:{port}/json")
            return next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        except (OSError, StopIteration):
            time.sleep(0.5)
    raise SystemExit("chromium's DevTools did not answer within 30 s")


if __name__ == "__main__":
    main()
