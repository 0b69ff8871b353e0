"""The policy network, and its storage as safetensors weights plus a JSON config.

No pickle anywhere: a model folder holds `model.safetensors` and `config.json`, and loading
one builds the network from the config and copies tensors in, so nothing in the folder can
run code.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from edge.runtime import EpisodeInputs
from pipelines.contract.schema import ACTION_FIELDS, ACTION_SIZE, OBS_FIELDS, OBS_SIZE

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FEATURE_SIZE = 11  # from the newest observation
PAST_FEATURE_SIZE = 4  # from each older one (`history` > 1): its command, where the part was
MAX_MEMBERS = 8  # PolicyConfig.ensemble, as params.yaml allows it


def feature_size(config: PolicyConfig) -> int:
    return FEATURE_SIZE + PAST_FEATURE_SIZE * (config.history - 1)


def input_size(config: PolicyConfig) -> int:
    """How many values the network takes: `history` observations (edge.runtime.stacked_inputs)."""
    return config.history * OBS_SIZE


@dataclass
class PolicyConfig:
    hidden: list[int] = field(default_factory=lambda: [128, 128])
    version: str = "sim-0"
    observation: list[str] = field(default_factory=lambda: list(OBS_FIELDS))
    action: list[str] = field(default_factory=lambda: list(ACTION_FIELDS))
    trained_on: dict = field(default_factory=dict)  # provenance: world, seed, dataset version
    # Hidden widths of a residual head (train.mode `residual`): its output is added to the
    # network's pre-activation, so base and head stay one network, one file, one ONNX graph.
    # None: no head (and no key in config.json, so plain policies' files are as before).
    residual: list[int] | None = None
    # Observations the network sees at once: the newest and `history - 1` before it. With a
    # 2-4 step drive lag the commands still in flight decide where the gantry goes next, and
    # several camera frames average out the part's pose noise; one frame shows neither.
    # 1 (no key in config.json): the one-frame student every earlier model is.
    history: int = 1
    # The output is `output_gain * tanh`, clipped to -1..1 outside training. The expert drives
    # at full speed on a sixth of its steps, which tanh alone reaches only at infinite
    # pre-activation: a gain of 1 leaves a student ~10% slower there, and late (timeouts).
    output_gain: float = 1.0
    # Students trained side by side on the same examples, each from its own random start and
    # on its own error; the policy acts on the mean of their actions, which errs less than
    # most of them: on cell-07's winter-lit line 3 members placed 95.5 where single students
    # placed 92.6, on cell-09 no better (docs/calibration.md, "Several students averaged").
    # 1 (no key in config.json): one network, as every earlier model.
    ensemble: int = 1


class MemberLayers(nn.Module):
    """`members` MLPs of one shape as one module: each layer's weights stacked on a leading
    member axis, so one matmul runs every member (and ONNX sees one graph). Each member starts
    as nn.Linear would start it, from its own draw. (M, width) in -> (members, M, out): the
    last layer's pre-activation, per member."""

    def __init__(self, members: int, widths: list[int]):
        super().__init__()
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        for fan_in, fan_out in itertools.pairwise(widths):
            layers = [nn.Linear(fan_in, fan_out) for _ in range(members)]
            self.weights.append(nn.Parameter(torch.stack([layer.weight.T for layer in layers])))
            self.biases.append(nn.Parameter(torch.stack([layer.bias[None] for layer in layers])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.weights) - 1
        for k, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = torch.matmul(x, weight) + bias
            x = torch.tanh(x) if k < last else x
        return x


class PolicyNet(nn.Module):
    """MLP on relative features: what the pusher must do depends on where things are
    relative to each other, not on absolute table coordinates."""

    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.config = config
        if config.ensemble > 1:
            widths = [feature_size(config), *config.hidden, ACTION_SIZE]
            self.members = MemberLayers(config.ensemble, widths)
        else:
            layers: list[nn.Module] = []
            width = feature_size(config)
            for hidden in config.hidden:
                layers += [nn.Linear(width, hidden), nn.Tanh()]
                width = hidden
            layers += [nn.Linear(width, ACTION_SIZE), nn.Tanh()]
            self.mlp = nn.Sequential(*layers)
        if config.residual is not None:
            self.residual = residual_head(config.residual, feature_size(config))

    def features(self, stacked: torch.Tensor) -> torch.Tensor:
        """(..., history * 12) stacked observations -> the network's input features."""
        newest = self.frame_features(stacked[..., :OBS_SIZE])
        pusher, past = stacked[..., 0:2], []
        for k in range(1, self.config.history):
            frame = stacked[..., k * OBS_SIZE : (k + 1) * OBS_SIZE]
            # the part as that frame saw it, from where the pusher is now: several noisy
            # frames of one part; and the command sent then, which may only now arrive
            past += [(frame[..., 4:6] - pusher) * 10.0, frame[..., 10:12]]
        return torch.cat([newest, *past], dim=-1) if past else newest

    @staticmethod
    def frame_features(obs: torch.Tensor) -> torch.Tensor:
        pusher, velocity = obs[..., 0:2], obs[..., 2:4]
        part, yaw, confidence = obs[..., 4:6], obs[..., 6:7], obs[..., 7:8]
        target, last_action = obs[..., 8:10], obs[..., 10:12]
        to_part = (part - pusher) * 10.0  # decimetres keep the inputs near unit scale
        to_target = (target - part) * 10.0
        return torch.cat(
            [
                to_part,
                to_target,
                velocity * 4.0,
                confidence,
                last_action,
                torch.sin(4 * yaw),
                torch.cos(4 * yaw),
            ],
            dim=-1,
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        action = self.member_actions(obs)
        if self.config.ensemble > 1:
            action = action.mean(dim=0)
        if self.config.output_gain == 1.0:
            return action
        # Clipped only when acting: in training a clip would stop the gradient of an output
        # past 1 whatever its label, and leave it stuck there.
        return action if self.training else action.clamp(-1.0, 1.0)

    def member_actions(self, obs: torch.Tensor) -> torch.Tensor:
        """Each member's action, unclipped: (ensemble, ..., 2), or (..., 2) for one network.
        Training fits every member to the labels on its own (pipelines.training.train)."""
        features = self.features(obs)
        if self.config.ensemble == 1 and self.config.residual is None:
            action = self.mlp(features)
        else:
            # A residual correction acts before the output's tanh: the action stays in -1..1.
            pre = self._preactivation(features)
            if self.config.residual is not None:
                pre = pre + self.residual(features)
            action = torch.tanh(pre)
        return action if self.config.output_gain == 1.0 else action * self.config.output_gain

    def _preactivation(self, features: torch.Tensor) -> torch.Tensor:
        if self.config.ensemble == 1:
            return self.mlp[:-1](features)
        flat = self.members(features.reshape(-1, features.shape[-1]))
        return flat.reshape(self.config.ensemble, *features.shape[:-1], ACTION_SIZE)


def residual_head(hidden: list[int], width: int = FEATURE_SIZE) -> nn.Sequential:
    """A small MLP on the policy's features (`width` of them) whose last layer starts at zero:
    added to a base, it leaves the base's actions exactly as they were until training moves it."""
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(width, size), nn.Tanh()]
        width = size
    last = nn.Linear(width, ACTION_SIZE)
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)
    return nn.Sequential(*layers, last)


class Policy:
    """A loaded policy as the cell's controller: `act(obs)` once per step of an episode.

    A policy with `history` > 1 remembers the episode's observations: `begin_episode()` at
    each episode's start, and `observe(obs)` on a step something else drives (the operator),
    so its frames stay in step with the cell's."""

    def __init__(self, net: PolicyNet, path: Path | None = None):
        self.net = net.eval()
        self.path = path
        self.name = net.config.version
        self.episode = EpisodeInputs(net.config.history)

    def begin_episode(self) -> None:
        self.episode.begin()

    def observe(self, obs: np.ndarray) -> np.ndarray:
        """Remember `obs`; the input the network would act on now."""
        return self.episode.push(obs)

    @torch.inference_mode()
    def act(self, obs: np.ndarray) -> np.ndarray:
        return self.net(torch.from_numpy(self.observe(obs))).numpy().astype(float)


def save_policy(
    net: PolicyNet, folder: str | Path, extra: Callable[[Path], object] | None = None
) -> Path:
    """Write weights and config; the folder appears complete or not at all. `extra` writes
    more files into the staging folder first (the edge files: pipelines.training.onnx_export);
    if it raises, nothing is written."""
    folder = Path(folder)
    staging = folder.with_name(folder.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)  # a killed save's leftovers: never mixed into this one
    staging.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, staging / WEIGHTS_FILE)
    config = asdict(net.config)
    # a plain one-frame policy's config.json reads as it always has
    if config["residual"] is None:
        del config["residual"]
    for key, plain in (("history", 1), ("output_gain", 1.0), ("ensemble", 1)):
        if config[key] == plain:
            del config[key]
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    if extra is not None:
        try:
            extra(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if folder.exists():
        _replace_dir(staging, folder)
    else:
        staging.rename(folder)
    return folder


def load_policy(folder: str | Path) -> Policy:
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: missing; a policy folder holds {CONFIG_FILE} and {WEIGHTS_FILE}"
            )
    try:
        config = PolicyConfig(**json.loads(config_path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{config_path}: not a policy config ({exc})") from None
    if config.observation != list(OBS_FIELDS):
        raise ValueError(f"{config_path}: observation fields differ from this cell's {OBS_SIZE}")
    if not _valid_student(config):
        raise ValueError(
            f"{config_path}: history {config.history!r} must be a whole number of frames from 1, "
            f"output_gain {config.output_gain!r} from 1 to 2, ensemble {config.ensemble!r} a "
            f"whole number of members from 1 to {MAX_MEMBERS}; train or pull the policy again"
        )
    net = PolicyNet(config)
    try:
        net.load_state_dict(load_file(weights_path))
    except (SafetensorError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0]
        raise ValueError(f"{weights_path}: unreadable or mismatched weights ({reason})") from None
    return Policy(net, folder)


def _valid_student(config: PolicyConfig) -> bool:
    """A whole number of frames from 1 and of members from 1 to MAX_MEMBERS, and an output
    gain from 1 to 2 (as params allow)."""
    gain, members = config.output_gain, config.ensemble
    frames_ok = type(config.history) is int and config.history >= 1
    members_ok = type(members) is int and 1 <= members <= MAX_MEMBERS
    return frames_ok and members_ok and type(gain) in (int, float) and 1 <= gain <= 2


def _replace_dir(new: Path, old: Path) -> None:
    trash = old.with_name(old.name + ".old")
    old.rename(trash)
    new.rename(old)
    for child in trash.iterdir():
        child.unlink()
    trash.rmdir()
