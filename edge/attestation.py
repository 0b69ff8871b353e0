"""Gate attestations: the gate's verdict as a signed in-toto Statement v1 in a DSSE envelope.

The statement's subject is the candidate's model.safetensors (its sha256); its predicate is what
the gate judged: the trial request, both arms' statistics, the verdict and its reasons. Only the
gate stage holds the gate key; promotion and the edge box both verify the envelope against the
gate's public key (on the box: `gate-keys.json`, a target signed by the targets role), and that
the subject is exactly the bytes they are about to publish or run.
"""

from __future__ import annotations

import json
from typing import Any

from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError
from securesystemslib.signer import Key, Signer, SSlibKey

from edge.errors import EdgeError

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://realloop.dev/gate/v1"
SUBJECT_NAME = "model.safetensors"


def sign_gate_attestation(model_sha256: str, predicate: dict[str, Any], signer: Signer) -> bytes:
    """The DSSE envelope (JSON bytes) of a gate statement about `model_sha256`."""
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": SUBJECT_NAME, "digest": {"sha256": model_sha256}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    envelope = Envelope(payload, PAYLOAD_TYPE, {})
    envelope.sign(signer)
    return (json.dumps(envelope.to_dict(), indent=2, sort_keys=True) + "\n").encode()


def verify_gate_attestation(
    data: bytes, gate_keys: list[Key], model_sha256: str, where: str = "gate attestation"
) -> dict[str, Any]:
    """The predicate of a passing attestation for exactly `model_sha256`; EdgeError otherwise
    (unsigned or signed by another key, another subject, or a verdict that is not a pass)."""
    try:
        envelope = Envelope.from_dict(json.loads(data))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise EdgeError(f"{where}: not a DSSE envelope ({exc})") from None
    if envelope.payload_type != PAYLOAD_TYPE:
        raise EdgeError(f"{where}: payload type {envelope.payload_type!r}, not in-toto")
    try:
        envelope.verify(gate_keys, 1)
    except (VerificationError, ValueError):
        raise EdgeError(f"{where}: not signed by a gate key; refusing it") from None
    statement = _statement(envelope.payload, where)
    digests = [s.get("digest", {}).get("sha256") for s in statement.get("subject", [])]
    if model_sha256 not in digests:
        raise EdgeError(
            f"{where}: attests model sha256 {digests}, not {model_sha256}; "
            "it is about other bytes, refusing them"
        )
    predicate = statement.get("predicate")
    if not isinstance(predicate, dict) or predicate.get("verdict") != "pass":
        verdict = predicate.get("verdict") if isinstance(predicate, dict) else None
        raise EdgeError(f"{where}: the gate's verdict is {verdict!r}, not a pass; refusing it")
    return predicate


def gate_keys_from(data: bytes, where: str = "gate-keys.json") -> list[Key]:
    """The public keys a `gate-keys.json` document lists."""
    try:
        document = json.loads(data)
        return [
            SSlibKey.from_dict(k["keyid"], {f: v for f, v in k.items() if f != "keyid"})
            for k in document["keys"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise EdgeError(f"{where}: not a gate keys document ({exc})") from None


def summary(predicate: dict[str, Any]) -> dict[str, Any]:
    """What `status` shows of an attestation: request, verdict, the arms' success rates."""
    arms = predicate.get("arms") or {}
    return {
        "request_id": predicate.get("request_id"),
        "verdict": predicate.get("verdict"),
        "reasons": predicate.get("reasons", []),
        "success_rates": {
            arm: stats.get("success_rate") for arm, stats in arms.items() if isinstance(stats, dict)
        },
    }


def _statement(payload: bytes, where: str) -> dict[str, Any]:
    try:
        statement = json.loads(payload)
    except ValueError:
        raise EdgeError(f"{where}: the statement is not JSON") from None
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise EdgeError(f"{where}: not an in-toto Statement v1")
    if statement.get("predicateType") != PREDICATE_TYPE:
        raise EdgeError(f"{where}: predicate type {statement.get('predicateType')!r} is not ours")
    return statement
