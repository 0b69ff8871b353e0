"""Signed releases for tests: keys made once per keys folder, releases published the way the
promote stage does (edge.release.publish_release), gated ones with a real gate attestation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edge.attestation import sign_gate_attestation
from edge.integrity import sha256_file
from edge.keys import GATE, load_signer
from edge.release import publish_release
from edge.rotation import init_keys
from edge.tuf_client import enroll

EXPIRY_S = 86400.0


def passing_predicate(request_id: str = "trial-1") -> dict[str, Any]:
    arms = {
        "candidate": {"success_rate": 0.9, "interval": [0.8, 0.95]},
        "incumbent": {"success_rate": 0.7},
    }
    return {"request_id": request_id, "arms": arms, "verdict": "pass", "reasons": ["pass: test"]}


def attest(keys: Path, model: Path, predicate: dict[str, Any] | None = None) -> bytes:
    return sign_gate_attestation(
        sha256_file(model), predicate or passing_predicate(), load_signer(keys, GATE)
    )


def publish_signed(
    channel: str,
    keys: Path,
    cell: str,
    files: dict[str, Path],
    metadata: dict[str, Any],
    decision: dict[str, Any] | None = None,
    attestation: bytes | None = None,
) -> dict[str, Any]:
    """A signed release; a gated one (the default) attested as a pass for its model file."""
    init_keys(keys, channel, EXPIRY_S)
    decision = decision or {"kind": "gate"}
    if decision["kind"] in ("gate", "approval") and attestation is None:
        attestation = attest(keys, files["model.safetensors"])
    return publish_release(channel, keys, cell, files, metadata, decision, attestation, EXPIRY_S)


def enrolled(channel: str, keys: Path, cell: str, box: Path) -> Path:
    """`box` enrolled for `cell` with the keys folder's root.json (made first if needed)."""
    init_keys(keys, channel, EXPIRY_S)
    enroll(channel, cell, box, keys / "root.json")
    return box


_S3_KEYS: dict[str, Path] = {}


def keys_for(channel: str | Path) -> Path:
    """A keys folder for a test channel: beside a folder channel, a temporary one per S3 URI."""
    text = str(channel)
    if text.startswith("s3://"):
        import tempfile

        return _S3_KEYS.setdefault(text, Path(tempfile.mkdtemp(prefix="realloop-keys-")))
    return Path(text).parent / f"{Path(text).name}-keys"


def publish_override(
    channel: str | Path,
    cell: str,
    files: dict[str, Path],
    metadata: dict[str, Any],
    keys: Path | None = None,
) -> dict[str, Any]:
    """A signed release by override (no gate): what `realloop deploy --initial` publishes."""
    decision = {
        "kind": "override",
        "by": "test",
        "at": "2026-12-03T00:00:00+00:00",
        "reason": "test",
    }
    return publish_signed(str(channel), keys or keys_for(channel), cell, files, metadata, decision)
