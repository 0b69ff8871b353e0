"""`realloop ingest` on its two engines (the flow's thread pool, a Dask cluster) and on a
full disk: the same dataset either way; one line and a clean restart when the disk fills.

The slow tests run the command line as users do (a child process with its own ephemeral
Prefect API in the workspace); bench/fleet_ingest.py measures the engines at fleet size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.ingest_runner import ClusterError, describe, is_local, local_workers
from pipelines.ingest.store import dataset_content_hash, sha256_file
from tests.conftest import ROOT, without_prefect_settings
from tests.pipelines.test_ingest_disk_full import small_disk  # noqa: F401
from tests.pipelines.test_ingest_helpers import recorded_shift

pytestmark = pytest.mark.timeout(600)


def test_cluster_setting_is_parsed_or_refused_in_one_line():
    assert local_workers("local:3", 4) == 3
    assert 1 <= local_workers("local", 4) <= min(4, os.cpu_count() or 1)
    assert not is_local("localhost:8786") and is_local("local:2")
    assert describe(None, 4) == "thread pool (4 at a time)"
    assert describe("local:2", 4) == "Dask LocalCluster (2 worker processes)"
    assert describe("tcp://10.0.0.5:8786", 4) == "Dask cluster at tcp://10.0.0.5:8786"
    with pytest.raises(ClusterError) as refused:
        local_workers("local:zero", 4)
    assert str(refused.value).startswith("ingest.cluster: 'local:zero' is not `local`")
    assert "params.yaml" in str(refused.value)


def workspace(tmp_path: Path, name: str, landing: Path, **ingest) -> Path:
    """A workspace whose landing folder is `landing` (outside its data folder)."""
    root = tmp_path / name
    root.mkdir()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["ingest"].update(landing="landing", **ingest)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copytree(landing, root / "landing")
    return root


def run_ingest(root: Path, command: str = "ingest") -> subprocess.CompletedProcess:
    empty = root.parent / "empty-gitconfig"
    empty.write_text("")
    env = without_prefect_settings() | {"GIT_CONFIG_GLOBAL": str(empty)}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", command, "--json"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def landing() -> Path:
    shift, _, _ = recorded_shift()
    return shift


@pytest.mark.slow
def test_a_dask_cluster_ingests_the_same_dataset_as_the_thread_pool(tmp_path, landing):
    pool = workspace(tmp_path, "pool", landing)
    dask = workspace(tmp_path, "dask", landing, cluster="local:2")
    runs = {}
    for root in (pool, dask):
        done = run_ingest(root)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        runs[root.name] = json.loads(done.stdout)
    assert runs["dask"]["ingest"]["files_ingested"] == runs["pool"]["ingest"]["files_ingested"]
    assert runs["dask"]["ingest"]["files_ingested"] >= 3
    assert dataset_content_hash(dask / "data" / "dataset") == dataset_content_hash(
        pool / "data" / "dataset"
    )


@pytest.mark.slow
def test_a_full_disk_fails_ingest_in_one_line_and_the_next_run_completes(
    tmp_path,
    landing,
    small_disk,  # noqa: F811
):
    clean = workspace(tmp_path, "clean", landing)
    assert run_ingest(clean).returncode == 0
    root = workspace(tmp_path, "full", landing)
    before = {p.name: sha256_file(p) for p in (root / "landing").rglob("*") if p.is_file()}
    disk = small_disk(root / "data")
    disk.fill(leave=8192)
    done = run_ingest(root)
    assert done.returncode == 1 and done.stdout == ""
    staging = root / "data" / ".ingest-tmp"
    assert done.stderr.splitlines() == [
        f"realloop: ingest: disk full while staging the decoded Parquet at {staging}: "
        "free space and run again"
    ], done.stderr[-3000:]
    after = {p.name: sha256_file(p) for p in (root / "landing").rglob("*") if p.is_file()}
    assert after == before  # every landed file still there, unchanged
    assert not (root / "data" / "dataset.dvc").exists()  # no version, not even a partial one
    looped = run_ingest(root, "loop")  # the loop's own ingest says it the same way
    assert looped.returncode == 1 and looped.stderr.splitlines() == done.stderr.splitlines(), (
        looped.stderr[-3000:]
    )

    disk.free()
    again = run_ingest(root)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["ingest"]["files_ingested"] >= 3
    assert dataset_content_hash(root / "data" / "dataset") == dataset_content_hash(
        clean / "data" / "dataset"
    )
