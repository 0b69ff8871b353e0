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
