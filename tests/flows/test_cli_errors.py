"""What a user sees when a command cannot do what was asked: one line, exit status 1."""

import json
import os
import shutil
import time
from importlib.metadata import version

from typer.testing import CliRunner

from flows.cli import app
from pipelines.contract.params import load_params
from pipelines.training import tracking


def test_version_prints_the_installed_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"realloop {version('realloop')}\n"


def test_lineage_in_an_empty_workspace_is_one_line(tmp_path, monkeypatch, params_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)
    monkeypatch.chdir(tmp_path)
    shutil.copy(params_path, tmp_path / "params.yaml")
    result = CliRunner().invoke(app, ["lineage", "1"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "realloop: realloop-policy version 1: no version of realloop-policy is registered in "
        "this workspace yet; run `realloop loop` or `realloop train` first"
    ]


def test_gc_sweeps_old_interrupted_writes_from_channel_and_landing(
    tmp_path, monkeypatch, params_path
):
    monkeypatch.chdir(tmp_path)
    shutil.copy(params_path, tmp_path / "params.yaml")
    params = load_params(params_path)
    old = time.time() - 7200
    litter = {
        "channel": tmp_path / params.promote.channel / "cell-07" / ".CURRENT.json.k1.partial",
        "landing": tmp_path / params.ingest.landing / "cell-07" / "shift.mcap.partial",
    }
    for path in litter.values():
        path.parent.mkdir(parents=True)
        path.write_bytes(b"cut short")
        os.utime(path, (old, old))
    young = tmp_path / params.ingest.landing / "cell-07" / "next.mcap.partial"
    young.write_bytes(b"being uploaded")
    result = CliRunner().invoke(app, ["gc", "--older-than", "3600", "--json"])
    assert result.exit_code == 0, result.stderr
    removed = json.loads(result.stdout)
    assert removed["channel"]["removed"] == ["cell-07/.CURRENT.json.k1.partial"]
    assert removed["landing"]["removed"] == ["cell-07/shift.mcap.partial"]
    assert not any(p.exists() for p in litter.values()) and young.exists()
