"""`make demo` writes its own params.yaml from the project's: it must stay loadable as the
project's params grow (a section replaced wholesale would lose new required keys)."""

from __future__ import annotations

from flows.demo import Fleet, _write_demo_params
from pipelines.contract.params import load_params
from tests.conftest import ROOT


def test_the_demo_params_load_and_keep_every_section_of_the_projects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fleet = Fleet(landing="data/landing", channel="data/edge-channel", cells=["cell-07", "cell-08"])
    demo = load_params(_write_demo_params(ROOT / "params.yaml", fleet))
    project = load_params(ROOT / "params.yaml")
    assert list(demo.fleet.cells) == ["cell-07", "cell-08"]
    assert demo.fleet.canary == project.fleet.canary
    assert demo.trials.max_episodes == project.demo.trial_episodes
    assert demo.train.threads == 1
    assert demo.promote.keys == project.promote.keys  # signing stays on


def test_a_loud_subcommand_keeps_the_callers_stdout_for_its_json():
    """`demo` and `campaign --json` run `cell pretrain` loudly: its summary line goes to their
    stderr, or it would open their --json document (as it did in a clone without a sim policy)."""
    import subprocess
    import sys

    script = (
        "from flows.demo import _realloop; "
        "_realloop('cell', 'timeline', '--world', 'cell-07', quiet=False)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout == ""
    assert "camera knocked" in done.stderr
