"""`realloop validate` and `realloop admit` as users and scripts call them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from flows.validate_cli import _print_validation
from pipelines.quality.validate import validate_dataset
from tests.conftest import ROOT
from tests.pipelines.test_validate import BAD, GOOD, validated  # noqa: F401 (a fixture)


def realloop(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args, "--params", str(ROOT / "params.yaml")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "USER": "ana"},
    )


def test_validate_then_admit_from_the_command_line(params, validated, tmp_path, capsys):  # noqa: F811
    shutil.copytree(validated[0].parent, tmp_path / "data")  # results stored: no GX start

    run = realloop("validate", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["excluded_from_training"] == [BAD] and summary["cached"] == 2
    assert summary["data_docs"] == str(tmp_path / "data/validation/unversioned/index.html")

    run = realloop("admit", BAD[:10], "--reason", "clock fixed upstream", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert record["batch"] == BAD and record["by"] == "ana"
    assert record["reason"] == "clock fixed upstream"
    assert record["admissions"] == str(tmp_path / "data/validation/admissions.jsonl")

    # What people read (in-process: the same command would only reuse the stored results).
    report = validate_dataset(tmp_path / "data/dataset", params.cell, params.validate)
    _print_validation(report.as_dict())
    out = capsys.readouterr().out
    assert "2 batches, 1 passed every critical expectation, 0 excluded from training, " in out
    assert "1 re-admitted (0 validated now, 2 stored results reused)" in out
    assert f"admitted {BAD[:12]}: steps.time_s:" in out
    assert f"data docs: {report.data_docs}" in out

    run = realloop("admit", GOOD, "--reason", "just because", cwd=tmp_path)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        f"realloop: batch {GOOD[:12]} passed every critical expectation: nothing to admit"
    ]
