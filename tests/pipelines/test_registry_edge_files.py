"""The registry's copy of a policy carries its edge files (policy.onnx, ood.json, export.json),
so a release made from the registry (`realloop rollback`, `promote --override`) has them."""

from __future__ import annotations

import numpy as np
import torch

from pipelines.training import tracking
from pipelines.training.onnx_export import save_policy_for_edge
from pipelines.training.policy import PolicyConfig, PolicyNet
from pipelines.training.registry import EDGE_FILES, download_policy, register_policy
from pipelines.training.tracking import start_finetune_run


def test_a_downloaded_version_has_the_edge_files_it_was_registered_with(
    params, tmp_path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)
    torch.manual_seed(0)
    net = PolicyNet(PolicyConfig(hidden=[8], version="edge", trained_on={}))
    observations = np.random.default_rng(0).normal(size=(64, 12)).astype(np.float32)
    folder, _ = save_policy_for_edge(net, tmp_path / "policy", observations, 0.01)
    assert all((folder / name).is_file() for name in EDGE_FILES)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    train = params.train
    with start_finetune_run(workspace, train.experiment, train, "v1", "data", {}) as run:
        pass
    model = train.registered_model
    version = register_policy(run.info.run_id, folder, model, workspace=workspace)

    dest = download_policy(model, version, tmp_path / "download", workspace=workspace)
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["model.safetensors", "config.json", *EDGE_FILES]
    )
    for name in EDGE_FILES:
        assert (dest / name).read_bytes() == (folder / name).read_bytes(), name
