"""Training: the policy network, training and fine-tuning, MLflow tracking and the registry."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipelines.training.registry import (
    POLICY_SHA256_TAG,
    ModelVersionInfo,
    download_policy,
    model_version_info,
    model_version_record,
    model_version_summaries,
    production_version,
    record_gate,
    register_policy,
    set_production_alias,
)
from pipelines.training.tracking import (
    DB_FILE,
    current_workspace,
    log_calibration_run,
    log_training_batches,
    start_finetune_run,
    use_workspace,
)

if TYPE_CHECKING:
    from pipelines.training.policy import (
        Policy,
        PolicyConfig,
        PolicyNet,
        load_policy,
        save_policy,
    )
    from pipelines.training.retrain import fine_tune_and_register
    from pipelines.training.train import EpochMetrics, fit, seed_everything

# These need torch (1.5 s to import), which commands that only locate the MLflow store, such
# as `realloop ingest`, never use: imported on first access (PEP 562), not with the package.
_NEEDS_TORCH = {
    "EpochMetrics": "pipelines.training.train",
    "Policy": "pipelines.training.policy",
    "PolicyConfig": "pipelines.training.policy",
    "PolicyNet": "pipelines.training.policy",
    "fine_tune_and_register": "pipelines.training.retrain",
    "fit": "pipelines.training.train",
    "load_policy": "pipelines.training.policy",
    "save_policy": "pipelines.training.policy",
    "seed_everything": "pipelines.training.train",
}


def __getattr__(name: str) -> Any:
    if name not in _NEEDS_TORCH:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_NEEDS_TORCH[name]), name)


__all__ = [
    "DB_FILE",
    "POLICY_SHA256_TAG",
    "EpochMetrics",
    "ModelVersionInfo",
    "Policy",
    "PolicyConfig",
    "PolicyNet",
    "current_workspace",
    "download_policy",
    "fine_tune_and_register",
    "fit",
    "load_policy",
    "log_calibration_run",
    "log_training_batches",
    "model_version_info",
    "model_version_record",
    "model_version_summaries",
    "production_version",
    "record_gate",
    "register_policy",
    "save_policy",
    "seed_everything",
    "set_production_alias",
    "start_finetune_run",
    "use_workspace",
]
