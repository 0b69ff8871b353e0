"""The policy's files for the edge box: `policy.onnx`, `ood.json` and `export.json`.

The ONNX model is torch's export of the whole network (feature map and MLP), checked against
torch on up to PARITY_ROWS of the policy's own training inputs (observations, stacked as deep
as the policy's history, and the part footprint where it reads one): the largest absolute
difference of any action must be at most PARITY_TOLERANCE, or the folder is not written.
`export.json` records the check (and MLflow gets it: pipelines.training.tracking).
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import numpy as np
import torch

from edge.runtime import EXPORT_FILE, ONNX_FILE, OOD_FILE, PolicySession
from pipelines.contract.schema import OBS_SIZE
from pipelines.training.ood import fit_ood, part_footprints
from pipelines.training.policy import PolicyNet, input_size, save_policy

PARITY_ROWS = 10_000
PARITY_TOLERANCE = 1e-5  # absolute, in normalised action units (-1..1)
OPSET = 17
# In the returned record (MLflow logs it) but not in export.json: onnxruntime's kernels, chosen
# by CPU, move its last bits, and the model folder must rebuild byte for byte on any machine.
MEASURED_HERE = ("parity_max_abs_diff",)


class ParityError(ValueError):
    """The ONNX export does not compute what the torch network does."""


def export_onnx(net: PolicyNet) -> bytes:
    """The network as ONNX bytes, batch size free. The TorchScript exporter (`dynamo=False`)
    needs no onnxscript, which the training stack does not otherwise use."""
    example = torch.zeros(1, input_size(net.config))
    buffer = io.BytesIO()
    net.eval()
    # torch calls this exporter legacy (the dynamo one needs onnxscript); for a plain MLP it
    # gives the same graph, and the parity check below is what vouches for it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            net,
            (example,),
            buffer,
            input_names=["observation"],
            output_names=["action"],
            dynamic_axes={"observation": {0: "batch"}, "action": {0: "batch"}},
            opset_version=OPSET,
            dynamo=False,
        )
    return buffer.getvalue()


def parity_rows(observations: np.ndarray, seed: int = 0) -> np.ndarray:
    """Up to PARITY_ROWS of the observations, drawn without replacement (all if fewer)."""
    observations = np.asarray(observations, dtype=np.float32)
    if len(observations) <= PARITY_ROWS:
        return observations
    pick = np.random.default_rng(seed).choice(len(observations), PARITY_ROWS, replace=False)
    return observations[np.sort(pick)]


def write_edge_files(
    net: PolicyNet,
    folder: Path,
    observations: np.ndarray,
    ood_false_alarm: float,
    footprint_tolerance_m: float | None = None,
) -> dict:
    """Write policy.onnx, ood.json and export.json into `folder` (a staging folder); raise
    ParityError if onnxruntime and torch disagree by more than PARITY_TOLERANCE. With
    `footprint_tolerance_m`, ood.json carries the part footprints the policy trained on.
    `observations`: the network's training inputs; the OOD model reads their newest frame."""
    folder = Path(folder)
    (folder / ONNX_FILE).write_bytes(export_onnx(net))
    footprints = part_footprints(net.config.trained_on)
    newest = np.asarray(observations)[:, :OBS_SIZE]
    ood = fit_ood(newest, ood_false_alarm, 0, footprints, footprint_tolerance_m)
    (folder / OOD_FILE).write_text(json.dumps(ood) + "\n")
    rows = parity_rows(observations)
    with torch.inference_mode():
        expected = net(torch.from_numpy(rows)).numpy()
    session = PolicySession(folder, min_confidence=0.0)
    worst = float(np.max(np.abs(session.act_batch(rows) - expected))) if len(rows) else 0.0
    record = {
        "onnx_opset": OPSET,
        "parity_observations": len(rows),
        "parity_max_abs_diff": worst,
        "parity_tolerance": PARITY_TOLERANCE,
        "parity_passed": worst <= PARITY_TOLERANCE,
        "ood_threshold": session.ood_model.threshold,
        "ood_false_alarm": ood_false_alarm,
    }
    if not record["parity_passed"]:
        raise ParityError(
            f"{folder / ONNX_FILE}: ONNX and torch actions differ by up to {worst:.2e} on "
            f"{len(rows)} training observations (allowed {PARITY_TOLERANCE:.0e}); not written"
        )
    written = {key: value for key, value in record.items() if key not in MEASURED_HERE}
    (folder / EXPORT_FILE).write_text(json.dumps(written, indent=2) + "\n")
    return record


def save_policy_for_edge(
    net: PolicyNet,
    folder: str | Path,
    observations: np.ndarray,
    ood_false_alarm: float,
    footprint_tolerance_m: float | None = None,
) -> tuple[Path, dict]:
    """`save_policy` with the edge files: every policy that can be promoted is written so.
    The folder appears complete, parity checked, or not at all. Returns (folder, export record)."""
    records: list[dict] = []

    def edge_files(staging: Path) -> None:
        records.append(
            write_edge_files(net, staging, observations, ood_false_alarm, footprint_tolerance_m)
        )

    return save_policy(net, folder, extra=edge_files), records[0]
