"""The ingest flow on Prefect's local API: one task per file, bounded concurrency, S3 retries,
versions, and the `realloop ingest` / `realloop datasets` commands.

Flows run in this process against an ephemeral API kept in a temporary workspace (started
once for the module); S3 is a moto server on loopback behind a proxy that injects real faults.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from uuid import UUID

import pyarrow.parquet as pq
import pytest
import yaml

from pipelines.ingest.sources import STAGING_DIR, s3_client
from tests.conftest import ROOT
from tests.flows.prefect_record import wait_for_log
from tests.pipelines.test_sources import FaultyProxy, proxy, s3_env, s3_server  # noqa: F401

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cli_workspace(tmp_path_factory):
    """The workspace whose .prefect holds this module's ephemeral API (the CLI test runs in
    it, so `realloop`'s own configure_prefect(cwd) points at the same place)."""
    from flows.prefect_env import configure_prefect

    saved = dict(os.environ)
    workspace = tmp_path_factory.mktemp("cli-workspace")
    configure_prefect(workspace)
    yield workspace
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def shift(tmp_path_factory, params_path) -> Path:
    """Three one-episode logs (and any captures) recorded on the line by the expert."""
    from flows.cell import run_record

    folder = tmp_path_factory.mktemp("shift")
    params = yaml.safe_load(params_path.read_text())
    params["record"]["episodes_per_file"] = 1
    small = folder / "params.yaml"
    small.write_text(yaml.safe_dump(params))
    run_record("expert", 3, folder / "logs", 3, False, "2026-12-01T06:00:00+00:00", small)
    return folder / "logs"


@pytest.fixture(autouse=True)
def git_identity(monkeypatch, tmp_path):
    empty = tmp_path / "empty-gitconfig"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))


def workspace_with(tmp_path: Path, name: str = "ws") -> tuple[Path, Path]:
    root = tmp_path / name
    root.mkdir()
    params = root / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    return root, params


def logs(shift: Path) -> list[Path]:
    return sorted(shift.glob("*.mcap"))


def task_runs(flow_run_id: str, count: int, timeout_s: float = 40.0) -> list:
    """The flow run's task runs once the API has recorded `count` finished ones."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    wanted = FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)]))
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=wanted)
        finished = [r for r in runs if r.state_type and r.state_type.value == "COMPLETED"]
        if len(finished) >= count or time.monotonic() > deadline:
            return finished
        time.sleep(0.5)


def names(runs: list) -> list[str]:
    """Task run names, without the random suffix of default names ("list-source-015")."""
    return sorted(r.name if " " in r.name else r.name.rsplit("-", 1)[0] for r in runs)


def git(workspace: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(workspace), *args], capture_output=True, text=True, check=True
    ).stdout


def test_landing_folder_one_task_per_file_with_bounded_concurrency(
    cli_workspace, shift, tmp_path, monkeypatch
):
    import flows.ingest as ingest_module

    root, params = workspace_with(tmp_path)
    landing = root / "data" / "landing"
    landing.mkdir(parents=True)
    first_logs = logs(shift)[:2]
    for log in first_logs:
        shutil.copy(log, landing / log.name)
    (landing / "cell-07_empty.mcap").write_bytes(b"")

    # Two workers: never more than two files in flight, whatever the thread pool allows.
    monkeypatch.setattr(ingest_module, "DEFAULT_WORKERS", 2)
    import pipelines.ingest

    real, active, peak, lock = pipelines.ingest.ingest_file, [0], [0], threading.Lock()

    def counting(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.3)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(pipelines.ingest, "ingest_file", counting)

    first = ingest_module.ingest_flow(str(params), str(root))
    report = first["ingest"]
    assert report["files_landed"] == 3 == report["files_ingested"] + report["files_quarantined"]
    assert (report["files_ingested"], report["files_quarantined"]) == (2, 1)
    assert "empty" in report["quarantined"][0]["reason"]
    assert peak[0] == 2
    assert names(task_runs(report["run_id"], 5)) == sorted(
        ["list-source", "version-dataset"]
        + [f"ingest {p.name}" for p in [*first_logs, landing / "cell-07_empty.mcap"]]
    )
    assert first["dataset"]["new"] and first["dataset"]["tag"].startswith("dataset-")

    # Nothing new: no ingest task at all (known files cost no task), no commit, same version.
    again = ingest_module.ingest_flow(str(params), str(root))
    assert again["dataset_version"] == first["dataset_version"] and not again["dataset"]["new"]
    assert (again["ingest"]["files_landed"], again["ingest"]["files_skipped"]) == (2, 2)
    assert names(task_runs(again["ingest"]["run_id"], 2)) == ["list-source", "version-dataset"]

    # Each run says what it did in a sentence and leaves an `ingest-report` artifact.
    said = wait_for_log(first["ingest"]["run_id"], "new file(s)")
    assert any(
        m.startswith("ingested 2 new file(s)") and "from 1 cell(s) (cell-07: 2)" in m
        for m in said["logs"]
    ), said["logs"]
    [artifact] = [a for a in said["artifacts"] if a["key"] == "ingest-report"]
    assert artifact["type"] == "markdown" and "| cell-07 | 2 |" in artifact["data"]
    assert "cell-07_empty.mcap" in artifact["data"]  # quarantined, with its reason
    said = wait_for_log(again["ingest"]["run_id"], "nothing new")
    assert any(m.startswith("nothing new, 2 already seen") for m in said["logs"]), said["logs"]

    # One more log: one new version, "+1 files".
    shutil.copy(logs(shift)[2], landing / logs(shift)[2].name)
    third = ingest_module.ingest_flow(str(params), str(root))
    assert third["ingest"]["files_ingested"] == 1 and third["ingest"]["files_skipped"] == 2
    assert third["dataset"]["new"] and third["dataset"]["sources_added"] == 1
    subjects = git(root, "log", "--format=%s").splitlines()
    assert subjects == [
        f"dataset {third['dataset_version']}: +1 files",
        f"dataset {first['dataset_version']}: +2 files",
    ]


def test_s3_source_survives_transient_faults(cli_workspace, shift, tmp_path, s3_env):  # noqa: F811
    from flows.ingest import ingest_flow
    from pipelines.ingest.store import read_dataset

    bucket = f"realloop-{uuid.uuid4().hex[:12]}"
    client = s3_client()
    client.create_bucket(Bucket=bucket)
    files = sorted(p for p in shift.rglob("*") if p.is_file() and ".groundtruth" not in p.parts)
    for path in files:
        key = f"fleet/cell-07/{path.relative_to(shift).as_posix()}"
        client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    client.put_object(Bucket=bucket, Key="fleet/cell-07/captures/x_retry.json", Body=b"{not json")
    first, second, third = (p.name for p in logs(shift))
    s3_env.fail("drop", times=1, key="list-type")  # the listing: retried by botocore
    s3_env.fail("503", times=2, key=second)  # SlowDown twice: retried by botocore
    s3_env.fail("truncate", times=1, key=first)  # a cut body: retried by the Prefect task

    root, params = workspace_with(tmp_path)
    result = ingest_flow(str(params), str(root), source=f"s3://{bucket}/fleet/cell-07")
    report = result["ingest"]
    assert s3_env.injected == {"drop": 1, "503": 2, "truncate": 1}
    assert (report["files_landed"], report["files_ingested"]) == (4, 3)
    (bad,) = report["quarantined"]  # the unreadable capture sidecar, named by its S3 URI
    assert bad["source"] == f"s3://{bucket}/fleet/cell-07/captures/x_retry.json"
    assert "capture" in bad["reason"] and Path(bad["moved_to"]).is_file()
    uris = sorted(row["source"] for row in report["ingested"])
    assert uris == [f"s3://{bucket}/fleet/cell-07/{name}" for name in (first, second, third)]
    episodes, _ = read_dataset(root / "data" / "dataset")
    assert sorted(set(episodes.column("source_uri").to_pylist())) == uris
    downloads = {r.name: r for r in task_runs(report["run_id"], len(files) + 6)}
    assert downloads[f"download {first}"].run_count == 2  # failed once, retried
    staged = root / "data" / "landing" / STAGING_DIR / bucket / "fleet" / "cell-07"
    assert not list(staged.glob("*.mcap"))  # ingested logs are not kept twice

    # The next run downloads nothing it already ingested.
    gets = sum(n for (method, _), n in s3_env.requests.items() if method == "GET")
    again = ingest_flow(str(params), str(root), source=f"s3://{bucket}/fleet/cell-07")
    assert (again["ingest"]["files_landed"], again["ingest"]["files_skipped"]) == (4, 4)
    assert not again["dataset"]["new"] and not again["ingest"]["quarantined"]
    regets = sum(n for (method, _), n in s3_env.requests.items() if method == "GET") - gets
    assert regets == 1  # the listing only


def test_ingest_and_datasets_commands(cli_workspace, shift, monkeypatch, s3_env):  # noqa: F811
    from typer.testing import CliRunner

    from flows.cli import app

    bucket = f"realloop-{uuid.uuid4().hex[:12]}"
    client = s3_client()
    client.create_bucket(Bucket=bucket)
    for path in logs(shift)[:2]:
        client.put_object(Bucket=bucket, Key=f"line/{path.name}", Body=path.read_bytes())
    shutil.copy(ROOT / "params.yaml", cli_workspace / "params.yaml")
    landing = cli_workspace / "data" / "landing"
    landing.mkdir(parents=True)
    shutil.copy(logs(shift)[2], landing / logs(shift)[2].name)
    monkeypatch.chdir(cli_workspace)
    runner = CliRunner()

    def realloop(*args: str):
        return runner.invoke(app, list(args), catch_exceptions=False)

    from_s3 = realloop("ingest", "--source", f"s3://{bucket}/line", "--json")
    assert from_s3.exit_code == 0, from_s3.stderr
    s3_report = json.loads(from_s3.stdout)
    counts = s3_report["ingest"]
    assert counts["files_landed"] == 2 == counts["files_ingested"]
    assert counts["files_landed"] == (
        counts["files_ingested"] + counts["files_skipped"] + counts["files_quarantined"]
    )
    local = realloop("ingest")  # the landing folder, human output
    assert local.exit_code == 0, local.stderr
    assert "new version dataset-" in local.stdout and "1 new logs" in local.stdout

    listing = realloop("datasets", "--json")
    assert listing.exit_code == 0, listing.stderr
    versions = json.loads(listing.stdout)["versions"]
    assert [v["episodes"] for v in versions] == [2, 3]
    assert versions[0]["version"] == s3_report["dataset_version"]
    assert all(s["uri"].startswith(f"s3://{bucket}/") for s in versions[0]["sources"])
    # a landing-folder file is named as the workspace names it: the name survives a move
    assert {s["uri"] for s in versions[1]["sources"]} >= {f"data/landing/{logs(shift)[2].name}"}
    assert [v["current"] for v in versions] == [False, True]

    dataset = cli_workspace / "data" / "dataset"
    older = realloop("datasets", "--checkout", versions[0]["tag"])
    assert older.exit_code == 0 and versions[0]["version"] in older.stdout
    assert len(list((dataset / "episodes").glob("*.parquet"))) == 2
    refused = realloop("ingest")
    assert refused.exit_code == 1 and "datasets --checkout latest" in refused.stderr
    assert realloop("datasets", "--checkout", "latest").exit_code == 0
    episodes = pq.read_table(dataset / "episodes", columns=["episode_id"])
    assert episodes.num_rows == 3

    bad = realloop("ingest", "--source", "ftp://example.com/logs")
    assert bad.exit_code == 1
    assert bad.stderr.strip().splitlines() == [
        "realloop: ftp://example.com/logs: unsupported source; use a folder, file:// or s3:// URI"
    ]
    missing = realloop("ingest", "--source", f"s3://{bucket}-gone/line", "--json")
    assert missing.exit_code == 1 and missing.stdout == ""
    assert missing.stderr.strip().splitlines() == [
        f"realloop: s3://{bucket}-gone/line: bucket '{bucket}-gone' does not exist"
    ]


def test_ingest_shows_a_bar_over_files_on_a_terminal_and_none_under_json(
    cli_workspace, shift, tmp_path, monkeypatch
):
    from rich.console import Console
    from typer.testing import CliRunner

    import flows.console
    from flows.cli import app

    root, _ = workspace_with(tmp_path)
    landing = root / "data" / "landing"
    landing.mkdir(parents=True)
    for log in logs(shift)[:2]:
        shutil.copy(log, landing / log.name)
    terminal = io.StringIO()  # stderr as a terminal: where the bar is drawn
    monkeypatch.setattr(
        flows.console, "stderr", Console(file=terminal, force_terminal=True, width=100)
    )
    monkeypatch.chdir(root)
    runner = CliRunner()

    human = runner.invoke(app, ["ingest"], catch_exceptions=False)
    assert human.exit_code == 0, human.stderr
    drawn = terminal.getvalue()
    assert "ingest" in drawn and "2/2" in drawn  # one bar over the files, to the last one
    assert "2 new logs" in human.stdout

    shutil.copy(logs(shift)[2], landing / logs(shift)[2].name)
    terminal.seek(0)
    terminal.truncate()
    quiet = runner.invoke(app, ["ingest", "--json"], catch_exceptions=False)
    assert quiet.exit_code == 0, quiet.stderr
    assert json.loads(quiet.stdout)["ingest"]["files_ingested"] == 1
    assert terminal.getvalue() == ""  # nothing drawn under --json
