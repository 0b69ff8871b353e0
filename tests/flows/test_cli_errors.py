"""What a user sees when a command cannot do what was asked: one line, exit status 1."""

import shutil
from importlib.metadata import version

from typer.testing import CliRunner

from flows.cli import app
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
