"""The edge files next to the weights: ONNX parity with torch, the OOD statistics, refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edge.runtime import EXPORT_FILE, ONNX_FILE, OOD_FILE, PolicySession
from pipelines.training import onnx_export
from pipelines.training.onnx_export import ParityError, save_policy_for_edge
from pipelines.training.ood import fit_ood
from pipelines.training.policy import PolicyConfig, PolicyNet, load_policy


def observations(n: int, seed: int = 0, confidence: float = 0.93) -> np.ndarray:
    """Plausible cell observations: positions on the table, moderate speeds, good light."""
    rng = np.random.default_rng(seed)
    obs = np.empty((n, 12), np.float32)
    obs[:, 0:2] = rng.uniform(-0.2, 0.2, (n, 2))  # pusher
    obs[:, 2:4] = rng.normal(0, 0.05, (n, 2))  # velocity
    obs[:, 4:6] = obs[:, 0:2] + rng.normal(0, 0.05, (n, 2))  # part near the pusher
    obs[:, 6] = rng.uniform(-np.pi, np.pi, n)
    obs[:, 7] = np.clip(rng.normal(confidence, 0.02, n), 0, 1)
    obs[:, 8:10] = rng.uniform(-0.2, 0.2, (n, 2))
    obs[:, 10:12] = np.clip(obs[:, 2:4] * 5 + rng.normal(0, 0.05, (n, 2)), -1, 1)
    return obs


def tiny_net(seed: int = 0) -> PolicyNet:
    torch.manual_seed(seed)
    return PolicyNet(PolicyConfig(hidden=[16, 16], version=f"tiny-{seed}"))


def test_the_folder_holds_onnx_ood_and_a_parity_record_and_onnx_acts_as_torch(tmp_path):
    net, obs = tiny_net(), observations(3000)
    folder, record = save_policy_for_edge(net, tmp_path / "policy", obs, 0.01)
    for name in (ONNX_FILE, OOD_FILE, EXPORT_FILE, "model.safetensors", "config.json"):
        assert (folder / name).is_file(), name
    written = json.loads((folder / EXPORT_FILE).read_text())
    assert written == {k: v for k, v in record.items() if k != "parity_max_abs_diff"}
    assert record["parity_observations"] == 3000 and record["parity_passed"] is True
    assert record["parity_max_abs_diff"] <= 1e-5
    session = PolicySession(folder, min_confidence=0.3)
    fresh = observations(200, seed=5)
    with torch.inference_mode():
        expected = net(torch.from_numpy(fresh)).numpy()
    assert np.abs(session.act_batch(fresh) - expected).max() <= 1e-5
    assert session.act(fresh[0]).shape == (2,) and session.name == "tiny-0"
    assert load_policy(folder).name == "tiny-0"  # the torch side still loads


def test_parity_is_checked_on_at_most_ten_thousand_training_observations(tmp_path):
    rows = onnx_export.parity_rows(observations(12_000))
    assert rows.shape == (10_000, 12)
    assert len(np.unique(rows, axis=0)) == 10_000


def test_a_folder_that_fails_parity_is_not_written(tmp_path, monkeypatch):
    other = tiny_net(seed=1)  # an export of different weights: ONNX no longer computes `net`
    real_export = onnx_export.export_onnx
    monkeypatch.setattr(onnx_export, "export_onnx", lambda net: real_export(other))
    with pytest.raises(ParityError, match=r"policy\.onnx: ONNX and torch actions differ"):
        save_policy_for_edge(tiny_net(), tmp_path / "policy", observations(500), 0.01)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no staging left


def test_a_failing_export_leaves_the_previous_policy_in_place(tmp_path, monkeypatch):
    folder, _ = save_policy_for_edge(tiny_net(), tmp_path / "policy", observations(500), 0.01)
    before = (folder / ONNX_FILE).read_bytes()
    monkeypatch.setattr(onnx_export, "export_onnx", lambda net: b"not onnx")
    with pytest.raises(ValueError, match="not a loadable ONNX model"):
        save_policy_for_edge(tiny_net(seed=2), folder, observations(500), 0.01)
    assert (folder / ONNX_FILE).read_bytes() == before
    assert load_policy(folder).name == "tiny-0"


def test_the_ood_threshold_holds_its_false_alarm_rate_and_flags_other_states():
    from edge.runtime import OodModel

    record = fit_ood(observations(20_000), false_alarm=0.01)
    model = OodModel.from_record(record, "ood.json")
    in_distribution = model.scores(observations(5000, seed=9)) > model.threshold
    assert 0.002 <= in_distribution.mean() <= 0.03
    dark = observations(1000, seed=3, confidence=0.5)  # the light dropped: confidence falls
    assert (model.scores(dark) > model.threshold).mean() > 0.95
    assert record["calibration_rows"] > 0 and record["fit_rows"] > record["calibration_rows"]


def test_too_few_observations_for_a_covariance_is_refused():
    with pytest.raises(ValueError, match="at least 30"):
        fit_ood(observations(10), 0.01)


@pytest.mark.slow  # a fresh MLflow store: about 15 s on 2 shared cores (make test-all)
def test_the_parity_check_and_threshold_are_recorded_on_the_fine_tune_run(
    tmp_path, params, monkeypatch
):
    from pathlib import Path

    from mlflow import MlflowClient

    from pipelines.training import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)
    train = params.train
    with tracking.start_finetune_run(
        tmp_path, train.experiment, train, "v1", "data/dataset", {"examples": 500}
    ) as run:
        _, record = save_policy_for_edge(tiny_net(), tmp_path / "p", observations(500), 0.01)
        tracking.log_edge_export(record)
    logged = MlflowClient(tracking.tracking_uri(tmp_path)).get_run(run.info.run_id).data
    assert logged.metrics["onnx_parity_max_abs_diff"] == record["parity_max_abs_diff"]
    assert logged.metrics["ood_threshold"] == pytest.approx(record["ood_threshold"])
    assert logged.params["onnx_parity_observations"] == "500"
    assert logged.params["ood_false_alarm"] == "0.01"
    doc = (Path(__file__).resolve().parents[2] / "docs" / "tracking.md").read_text()
    names = {"onnx_parity_max_abs_diff", "ood_threshold", *logged.params} - set(train.__dict__)
    assert [n for n in names if not n.startswith("train.") and f"`{n}`" not in doc] == []


def test_a_fine_tune_knows_its_bases_parts_and_the_line_parts_it_trained_on_often_enough():
    from pipelines.training.ood import MIN_FOOTPRINT_EPISODES, learned_footprints, part_footprints

    trained_on = {"base_trained_on": {"base_trained_on": {"part_footprints_m": [0.06]}}}
    assert part_footprints(trained_on) == (0.06,) and part_footprints({"world": "sim"}) == ()
    rng = np.random.default_rng(0)
    measured = np.concatenate(
        [
            rng.normal(0.06, 0.0014, 200),  # the part the base knows
            rng.normal(0.072, 0.0014, MIN_FOOTPRINT_EPISODES),  # a new box, often enough
            rng.normal(0.044, 0.0014, MIN_FOOTPRINT_EPISODES - 1),  # a new part, too rarely
            [np.nan],  # an episode logged without its footprint
        ]
    )
    (known, new) = learned_footprints((0.06,), measured, 0.005)
    assert known == 0.06 and new == pytest.approx(0.072, abs=0.001)
    assert learned_footprints((), measured, 0.005) == ()  # a base without a record
