"""The policy as an MLflow pyfunc model, logged as code ("models from code").

MLflow records this file itself (not a pickled object) as the model's code, and the policy's
two files as the model's artifacts, so `mlflow.pyfunc.load_model(...)` runs this module and
then `load_context`, which builds the network from `config.json` and copies the safetensors
weights in (`pipelines.training.policy.load_policy`). Nothing in a logged model is unpickled.

Input: a table with one float32 column per observation field (`OBS_FIELDS`), a row per
observation; output: one column per action field (`ACTION_FIELDS`), the policy's action. A
policy that remembers (PolicyConfig.history > 1) reads the rows as one episode in time order.
Loading needs realloop importable (the network's code lives in pipelines.training.policy).
"""

# No `from __future__ import annotations`: MLflow reads predict's type hints as classes.
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

# Names of the model's artifacts (MLflow copies each file under artifacts/ in the model).
WEIGHTS_ARTIFACT = "weights"
CONFIG_ARTIFACT = "config"


class PolicyModel(PythonModel):
    def load_context(self, context) -> None:
        from pipelines.training.policy import load_policy

        weights = Path(context.artifacts[WEIGHTS_ARTIFACT])
        config = Path(context.artifacts[CONFIG_ARTIFACT])
        if weights.parent != config.parent:
            raise ValueError(f"{weights}: the policy's weights and config must share a folder")
        self.policy = load_policy(weights.parent)

    # A DataFrame hint: MLflow validates the input against the signature, and infers nothing.
    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        import numpy as np
        import torch

        from pipelines.contract.schema import ACTION_FIELDS, OBS_FIELDS

        observations = np.asarray(model_input[list(OBS_FIELDS)], dtype=np.float32)
        self.policy.begin_episode()
        inputs = np.zeros((len(observations), self.policy.episode.size), np.float32)
        for i, row in enumerate(observations):
            inputs[i] = self.policy.observe(row)
        with torch.inference_mode():
            actions = self.policy.net(torch.tensor(inputs)).numpy()
        return pd.DataFrame(actions, columns=list(ACTION_FIELDS))


mlflow.models.set_model(PolicyModel())
