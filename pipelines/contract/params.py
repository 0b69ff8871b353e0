"""params.yaml, loaded once into frozen, validated dataclasses.

Every stage reads its section from the object `load_params` returns; nothing keeps its own
copy of a default. Unknown or missing keys are errors, so a typo cannot silently fall back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)
from pydantic.dataclasses import dataclass

T = TypeVar("T")

_STRICT = ConfigDict(extra="forbid")
DEFAULT_PARAMS = Path("params.yaml")


class ParamsError(ValueError):
    """A configuration file (params.yaml, a calibration) cannot be used; the message names
    the file and the key."""


@dataclass(frozen=True, config=_STRICT)
class SafetyParams:
    joint_limit_m: float
    speed_mps: float
    contact_force_n: float


@dataclass(frozen=True, config=_STRICT)
class CellParams:
    cell_id: str
    robot_serial: str
    sensor_calibration_id: str
    control_hz: int
    max_steps: int
    success_tolerance_m: float
    settle_speed_mps: float
    max_speed_mps: float
    pusher_radius_m: float  # the tool's radius: where it touches the part
    safety: SafetyParams

    @property
    def dt(self) -> float:
        return 1.0 / self.control_hz


@dataclass(frozen=True, config=_STRICT)
class RandomizationParams:
    friction: tuple[float, float]
    part_mass_kg: tuple[float, float]
    joint_damping: tuple[float, float]
    pose_noise_m: tuple[float, float]
    latency_steps: tuple[int, int] | None = None  # None: the world's own delay distribution


# How a fit's learning rate moves: held, or cosine-annealed to zero over the fit's steps. A
# held rate leaves the weights wherever the last batches threw them: the same student,
# pretrained with five seeds, placed 78-94% on cell-09; annealed, 88-93% (docs/calibration.md).
LearningRateSchedule = Literal["constant", "cosine"]


@dataclass(frozen=True, config=_STRICT)
class ReinforceParams:
    """Fine-tuning the pretrained student on its own success in the sim (PPO:
    pipelines.training.reinforce). The defaults are the usual PPO ones."""

    iterations: NonNegativeInt  # 0: no fine-tune on success
    episodes_per_iteration: PositiveInt
    exploration_std: PositiveFloat  # Gaussian exploration, in units of the command limit
    anchor_weight: Annotated[float, Field(ge=0)]  # pull toward the imitation policy's actions
    learning_rate: PositiveFloat
    lanes: PositiveInt = 16  # episodes run side by side, the policy acting for all at once
    critic_learning_rate: PositiveFloat = 1e-3
    critic_warmup_iterations: NonNegativeInt = 3  # the critic learns alone first
    epochs: PositiveInt = 4  # passes over each iteration's steps
    minibatch_steps: PositiveInt = 1024
    clip: Annotated[float, Field(gt=0, lt=1)] = 0.2
    discount: Annotated[float, Field(gt=0, le=1)] = 0.99
    gae_lambda: Annotated[float, Field(ge=0, le=1)] = 0.95
    max_grad_norm: PositiveFloat = 0.5


@dataclass(frozen=True, config=_STRICT)
class PretrainParams:
    seed: int
    demo_episodes: int
    dagger_rounds: int
    dagger_episodes: int
    epochs: int
    batch_size: int
    learning_rate: float
    hidden: tuple[int, ...]
    out: str
    calibrated_out: str  # `cell pretrain --calibration`: the loop's base policy when present
    randomization: RandomizationParams
    # More DAgger rounds, up to this many, while the student's success in its own sim is
    # below `dagger_target_success` (the loop's: loop.pretrain_dagger_*); 0: exactly
    # `dagger_rounds`, as `realloop cell pretrain` does.
    dagger_max_rounds: int = 0
    dagger_target_success: float = 1.0
    learning_rate_schedule: LearningRateSchedule = "constant"
    # Observations the student sees at once (pipelines.training.policy.PolicyConfig.history).
    history: Annotated[int, Field(ge=1, le=8)] = 1
    output_gain: Annotated[float, Field(ge=1.0, le=2.0)] = 1.0  # (PolicyConfig)
    ensemble: Annotated[int, Field(ge=1, le=8)] = 1  # students averaged (PolicyConfig)
    # After imitation, fine-tune on success in the same sim (the loop's: loop.pretrain_reinforce);
    # None: imitation only, as `realloop cell pretrain` does.
    reinforce: ReinforceParams | None = None


@dataclass(frozen=True, config=_STRICT)
class OperatorParams:
    takeover_angle_deg: float
    takeover_after_steps: int
    hold_steps: int


@dataclass(frozen=True, config=_STRICT)
class RecordParams:
    episodes_per_file: int
    max_file_bytes: int
    capture_window_steps: int
    low_confidence: float
    operator: OperatorParams


@dataclass(frozen=True, config=_STRICT)
class DecodeLimitParams:
    """pipelines.ingest.mcap.DecodeLimits, as params.yaml spells it."""

    max_chunk_bytes: int
    max_compression_ratio: float
    max_records_per_chunk: int
    max_chunks_per_file: int


# `local`, `local:N` (N worker processes), or a Dask scheduler's address (tcp://host:8786).
DaskCluster = Annotated[
    str, StringConstraints(pattern=r"^(local(:[1-9][0-9]{0,3})?|[a-z]+://\S+|[^\s:/]+:[0-9]+)$")
]


@dataclass(frozen=True, config=_STRICT)
class IngestParams:
    landing: str
    dataset: str
    quarantine: str
    remote: str
    min_steps: int
    schedule_interval_s: int
    max_file_bytes: int  # a landed file larger than this is quarantined before decoding
    max_clock_jump_s: float  # a longer gap between steps of one episode is a clock jump
    settle_s: float  # a closed log in the landing folder is ingested once unchanged this long
    stale_after_s: float  # a log without its footer unchanged this long is truncated, not open
    joint_limit_margin_m: float  # readings beyond cell.safety.joint_limit_m + this: quarantined
    decode_limits: DecodeLimitParams  # what one MCAP file may ask of the decoder
    # Where the per-file tasks run (flows/ingest_runner.py): None, the flow's thread pool;
    # "local" or "local:N", a Dask LocalCluster; else a Dask scheduler's address.
    cluster: DaskCluster | None = None


@dataclass(frozen=True, config=_STRICT)
class ValidateParams:
    min_steps: int
    max_steps: int
    time_step_tolerance_s: float  # sampling jitter beyond this: a warning
    max_time_step_error_s: float  # beyond this: critical (the loop missed its period)
    joint_reading_margin_m: float
    cycle_time_tolerance_s: float  # cycle_time_s vs steps / control_hz: critical beyond
    action_match_tolerance: float  # intervention steps: command vs correction, a warning


FinetuneMode = Literal["full", "anchored", "residual"]  # train.mode (docs/operations.md)


@dataclass(frozen=True, config=_STRICT)
class TrainParams:
    seed: int
    epochs: int
    batch_size: int
    learning_rate: float
    val_fraction: float
    intervention_weight: float
    out: str
    experiment: str
    registered_model: str
    cycles: str  # per cell: what its last cycle trained on and measured (DVC metrics, plots)
    # How far fine-tuning may move the base (pipelines.training.finetune, docs/operations.md);
    # the knobs after it belong to one mode each and are ignored by the others.
    mode: FinetuneMode
    anchor_weight: Annotated[float, Field(ge=0)]  # L2-SP: loss per squared weight distance
    distill_weight: Annotated[float, Field(ge=0)]  # the base's own action as a label: its weight
    residual_hidden: tuple[PositiveInt, ...]  # the residual head's hidden widths
    threads: PositiveInt | None = None  # torch intra-op threads; None: one per core


@dataclass(frozen=True, config=_STRICT)
class TrialsParams:
    # the cap per arm in one attempt (docs/operations.md, the cell contract); the sequential
    # gate (docs/gate.md) usually stops the trials before it
    max_episodes: PositiveInt
    timeout_s: PositiveFloat  # a request not complete by then is withdrawn: no promotion
    poll_s: PositiveFloat  # the loop ingests and checks for completion this often


# A cell id names the cell's channel path and registry alias (edge.bundle's safe names).
CellId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


@dataclass(frozen=True, config=_STRICT)
class FleetParams:
    cells: Annotated[tuple[CellId, ...], Field(min_length=1)]  # `realloop loop` without --cell
    # Staged rollout (flows/rollout.py): None, every cell gets its own candidate; a cell id, the
    # fleet cycle trains and trials on that cell only and the others get its model after its
    # health window passed.
    canary: CellId | None
    health_timeout_s: PositiveFloat  # seconds: no whole health window by then, rollout stops

    def __post_init__(self) -> None:
        if self.canary is not None and self.canary not in self.cells:
            raise ValueError(f"canary {self.canary} is not one of fleet.cells {list(self.cells)}")


@dataclass(frozen=True, config=_STRICT)
class GateParams:
    # docs/gate.md: the sequential non-inferiority test of candidate vs incumbent
    alpha: Annotated[float, Field(gt=0, lt=0.5)]  # one-sided error: a worse candidate passes
    margin: Annotated[float, Field(ge=0, lt=1)]  # success rate (absolute) it may lose
    looks: PositiveInt  # planned looks, evenly spaced up to trials.max_episodes per arm
    futility_power: Annotated[float, Field(ge=0, lt=1)]  # stop below this conditional power
    cycle_time_budget_s: float


@dataclass(frozen=True, config=_STRICT)
class PromoteParams:
    channel: str
    alias_suffix: str
    keys: str  # the TUF keys folder (root kept in its offline/), relative to the workspace
    timestamp_expiry_s: float  # seconds a signed timestamp stays valid: a box refuses older
    # Sign-off (flows/approval.py): after a passing gate the loop pauses for a person's
    # approve/reject in the Prefect UI; no answer within approval_timeout_s (seconds) rejects.
    require_approval: bool
    approval_timeout_s: PositiveInt


@dataclass(frozen=True, config=_STRICT)
class ServeParams:
    loop_cron: str
    timezone: str


@dataclass(frozen=True, config=_STRICT)
class DriftParams:
    out: str  # plots and drift.json per dataset version: <out>/<dataset_version>/
    min_episodes: int  # a feature is judged only with this many episodes on each side
    psi_bins: int
    psi: float
    ks_statistic: float
    js_distance: float
    p_value: float  # KS and chi-square: a difference must also be significant
    max_lag_steps: int
    jitter_clearance_m: float
    contact_band_m: float  # a pushing step: the part seen this close to its contact circle
    # part sizes: one within novel_tolerance_m of enough baseline sizes is known, and
    # novel_share more of the current than of the baseline unknown is a new variant
    novel_tolerance_m: PositiveFloat
    novel_share: Annotated[float, Field(gt=0, le=1)]
    min_drifted_features: int
    min_new_edge_cases: int


@dataclass(frozen=True, config=_STRICT)
class TriageParams:
    nominal_part_extent_m: float  # the part the cell is built for: its measured size
    extent_tolerance_m: float  # a part further off nominal than this is a different part
    max_part_turn_rad: float  # ...and so is one that turns further while pushed (a box)
    min_push_gap_m: float  # a larger part is blamed when the push gap is at least this
    min_confidence: float  # perception: mean confidence below this
    max_penetration_m: float  # ...or the pusher appears this deep inside the part
    max_pose_jitter_m: float  # ...or perceived position noise above this
    jitter_clearance_m: float  # noise measured only where the pusher is this far clear
    min_clear_steps: int  # fewer clear steps: noise measured over the whole window
    max_lag_steps: int  # latency estimate: lags 0..this, in control steps
    max_latency_steps: float  # control: estimated latency above this
    max_tracking_error_mps: float  # ...or RMS velocity tracking error above this
    slide_speed_mps: float  # the part moves, and this fast relative to the pusher: it slides
    max_slide_m: float  # physics: the part moved this far other than with the pusher
    # Capture snapshots (docs/triage.md, "Snapshots"): the table spans +-this (m) in the image;
    # a part whose drawn radius is further than part_radius_tolerance_m (m) from half the
    # nominal extent is another part; the camera's offset is fitted from at least
    # min_snapshots snapshots, and a standard part is taken to tolerate an offset up to
    # max_camera_offset_m (m); a box that swings round further than max_box_turn_rad was
    # chased round the table, which a cylinder would have been too.
    snapshot_half_width_m: float
    part_radius_tolerance_m: float
    min_snapshots: int
    max_camera_offset_m: float
    max_box_turn_rad: float
    # A replay in the calibrated sim (`realloop triage --policy --calibration`; triage/
    # counterfactual.py): each failed episode of another part whose camera offset is at most
    # replay_max_camera_offset_m is replayed replay_draws times with the standard part, and
    # the part is blamed when more than min_standard_part_success of those succeed.
    replay_draws: PositiveInt
    replay_max_camera_offset_m: float
    min_standard_part_success: float
    # Data selection (triage/selection.py): the loss weight of each step of an episode whose
    # part is not the standard one, against 1 for the rest (a factor): the line's unfamiliar
    # parts are where the sim policy never learned, so a uniform sample under-weights them.
    novel_part_weight: PositiveFloat
    worst_per_class: int  # worst episodes listed per class
    queue_length: int  # captures listed in the human report (JSON lists all)


@dataclass(frozen=True, config=_STRICT)
class CalibrateParams:
    episodes: int  # at most this many line episodes: the most recent whole shifts
    min_episodes: int  # fewer: refuse, the estimates would mislead
    out: str  # sim-calibration.yaml for the simulation team (and `cell pretrain`)
    plots: str  # replayed-vs-logged and fit-profile PNGs
    experiment: str  # MLflow experiment of calibration runs
    randomization_sigmas: float  # DR range: estimate +- this many standard errors...
    randomization_floor: float  # ...and at least +- this fraction of the estimate


@dataclass(frozen=True, config=_STRICT)
class SimulatorParams:
    """The simulator the pipeline uses where it needs one, as plug-ins named by import path
    (`package.module:name`, loaded by flows.plugins): the pipeline never imports a simulator."""

    replay: str  # called with CellParams: a pipelines.calibrate Simulator (calibration replays)
    world: str  # called with no arguments: the sim's world as a dict (a world file's keys)
    # The loop's calibrated candidates (flows/candidates.py): pretrain a policy in the sim a
    # calibration file describes, and measure a policy's success there (the pre-screen);
    # pipelines.release.prescreen's SimPretrain and SimEvaluate protocols.
    pretrain: str
    evaluate: str
    # Triage's replay (pipelines.quality.triage.StandardPartReplay): a failed episode's logged
    # start, replayed with the standard part in the sim a calibration file describes.
    counterfactual: str


# What a loop cycle builds per cell (docs/operations.md, "Candidates and the pre-screen").
CandidateName = Literal["incumbent_finetune", "calibrated", "calibrated_finetune"]


@dataclass(frozen=True, config=_STRICT)
class LoopParams:
    # Built per cell each cycle, in this order (a tie in the pre-screen goes to the first):
    # the production model fine-tuned; a policy pretrained in the sim calibrated from the
    # cell's newest shifts; that policy fine-tuned on the cell's data.
    candidates: Annotated[tuple[CandidateName, ...], Field(min_length=1)]
    heldout_shifts: NonNegativeInt  # newest shifts per cell kept out of fine-tuning: pre-screen
    train_shifts: PositiveInt | None  # ...and the newest this many before them fine-tuned on
    recalibrate_sigmas: PositiveFloat  # re-pretrain only if an estimate moved more (std errors)
    # The loop calibrates from the cell's newest whole shifts up to this many episodes, the
    # held-out shift included: the sim follows the line as it is now.
    calibrate_episodes: PositiveInt
    # The loop's pretrain (the `pretrain:` section stays `realloop cell pretrain`'s): cheaper,
    # since it runs inside a cycle; episodes, rounds and epochs as in `pretrain:`.
    pretrain_demo_episodes: PositiveInt
    pretrain_dagger_rounds: NonNegativeInt
    # ...and more rounds, up to max_rounds, while the student's success in its own
    # calibrated sim stays below target_success: a hard part mix needs more (bench notes)
    pretrain_dagger_max_rounds: NonNegativeInt
    pretrain_dagger_target_success: Annotated[float, Field(ge=0, le=1)]
    pretrain_dagger_episodes: PositiveInt
    pretrain_epochs: PositiveInt
    pretrain_learning_rate_schedule: LearningRateSchedule
    # The loop's student (PretrainParams, PolicyConfig): frames it sees, its output gain.
    pretrain_history: Annotated[int, Field(ge=1, le=8)]
    pretrain_output_gain: Annotated[float, Field(ge=1.0, le=2.0)]
    pretrain_ensemble: Annotated[int, Field(ge=1, le=8)]  # students averaged (PolicyConfig)
    sim_eval_episodes: PositiveInt  # pre-screen: episodes per candidate in the calibrated sim
    sim_eval_seed: int  # the same sim episodes for every candidate
    sim_weight: Annotated[float, Field(ge=0, le=1)]  # of sim success in the pre-screen score
    # calibrated_finetune starts from a strong base: fine-tuned `full`, it drifts toward the
    # operator's way and loses ~20 points; anchored keeps it (bench/efficacy).
    calibrated_finetune_mode: FinetuneMode = "anchored"
    # The loop's student, once imitation is done, fine-tuned on its own success in the
    # calibrated sim (PretrainParams.reinforce); None: imitation only
    pretrain_reinforce: ReinforceParams | None = None

    def __post_init__(self) -> None:
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"candidates {list(self.candidates)}: each may appear once")


@dataclass(frozen=True, config=_STRICT)
class DemoParams:  # `make demo`: reference cells as processes, the loop until each is promoted
    cells: Annotated[tuple[CellId, ...], Field(min_length=1)]
    episodes_per_shift: PositiveInt
    shifts: PositiveInt  # production shifts per cell; then a cell only runs trial requests
    speed: PositiveFloat  # cell seconds per wall second
    max_cycles: PositiveInt
    trial_episodes: PositiveInt  # per arm
    poll_s: PositiveFloat
    trial_timeout_s: PositiveFloat
    first_shift_timeout_s: PositiveFloat


@dataclass(frozen=True, config=_STRICT)
class CampaignParams:  # `realloop campaign`: the fleet over simulated days (docs/operations.md)
    cells: Annotated[tuple[CellId, ...], Field(min_length=1)]
    days: PositiveInt
    episodes_per_shift: PositiveInt
    shifts_per_day: PositiveInt  # production shifts start at fixed times of the line's day
    speed: PositiveFloat  # cell seconds per wall second: a day is 86,400 / speed wall seconds
    floor_days: PositiveInt  # the loop runs at least every this many days (the cron's floor)
    # a rise in the share of non-standard parts from the shift before, below this p, triggers it
    part_mix_p_value: Annotated[float, Field(gt=0, lt=1)]
    eval_episodes: PositiveInt  # per held-out seed
    eval_seeds: Annotated[tuple[int, ...], Field(min_length=1)]  # never used by the loop
    eval_workers: PositiveInt  # held-out evaluations at once (each a process)
    trial_episodes: PositiveInt  # per arm
    poll_s: PositiveFloat
    trial_timeout_s: PositiveFloat
    day_timeout_s: PositiveFloat  # wall seconds to wait for a day's shifts beyond its end


@dataclass(frozen=True, config=_STRICT)
class EdgeParams:
    """The box's runtime (edge/runtime.py) and its health check after each activation."""

    # Production episodes after an activation between the health check's looks (success rate
    # against the attested trial interval's lower end; a safety stop fails it at once).
    health_episodes: PositiveInt
    # Share of in-distribution steps the OOD score may flag: its threshold is this upper
    # quantile of the score on held-out training observations.
    ood_false_alarm: Annotated[float, Field(gt=0.0, lt=1.0)]
    # Perception confidence (0..1) below which the box hands the step to the fallback.
    min_confidence: Annotated[float, Field(ge=0.0, le=1.0)]
    # false: the box runs the policy on every step, screen off (a sim policy on the line hands
    # most steps to the operator: docs/operations.md, The box's runtime).
    fallback: bool
    # How far (m) a part's measured footprint may be from every part the policy trained on
    # before the box hands the episode to the fallback (the camera measures to about 2 mm).
    footprint_tolerance_m: Annotated[float, Field(gt=0.0)] = 0.005
    # The health check's longest window: below the floor but not significantly, it grows by
    # `health_episodes` up to this many episodes (pipelines.release.rollout.judge_counts).
    health_max_episodes: PositiveInt = 60

    def __post_init__(self) -> None:
        if self.health_max_episodes < self.health_episodes:
            raise ValueError(
                f"edge.health_max_episodes {self.health_max_episodes} is below "
                f"edge.health_episodes {self.health_episodes}: the window's first look"
            )


@dataclass(frozen=True, config=_STRICT)
class Params:
    cell: CellParams
    pretrain: PretrainParams
    record: RecordParams
    ingest: IngestParams
    validate: ValidateParams
    train: TrainParams
    trials: TrialsParams
    fleet: FleetParams
    gate: GateParams
    promote: PromoteParams
    serve: ServeParams
    drift: DriftParams
    triage: TriageParams
    calibrate: CalibrateParams
    simulator: SimulatorParams
    loop: LoopParams
    demo: DemoParams
    campaign: CampaignParams
    edge: EdgeParams


def load_params(path: str | Path = DEFAULT_PARAMS) -> Params:
    """Read params.yaml into `Params`; raise ParamsError with a one-line reason."""
    path = Path(path)
    return validated(Params, read_yaml(path, "pass --params PATH"), path)


def read_yaml(path: Path, if_missing: str) -> Any:
    """A YAML file's content; ParamsError naming the file if it is missing or not YAML."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found; {if_missing}") from None
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None


def validated(kind: type[T], raw: Any, path: Path, where: str = "") -> T:
    """`raw` as a `kind`; ParamsError naming the file and the first offending key."""
    try:
        return TypeAdapter(kind).validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = where + ".".join(str(p) for p in first["loc"]) or "<top>"
        raise ParamsError(f"{path}: {key}: {first['msg']}") from None
