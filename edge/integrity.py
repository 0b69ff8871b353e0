"""Hashes, canonical JSON and Ed25519 manifest signatures.

`cryptography` is imported inside the signing functions only: most edge commands never sign or
verify, and `realloop-edge --help` should start fast.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge.errors import EdgeError

SIGNATURE_FIELD = "signature"
_CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(document: Any) -> bytes:
    """The one byte form of a JSON document that hashes and signatures are computed over."""
    return json.dumps(
        document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def signed_payload(manifest: dict[str, Any]) -> bytes:
    """What a manifest signature covers: the canonical manifest without its signature."""
    unsigned = {key: value for key, value in manifest.items() if key != SIGNATURE_FIELD}
    return canonical_json(unsigned)


def generate_keypair(private_path: Path, public_path: Path) -> None:
    """Write a new Ed25519 key pair as PEM files; the private key is readable by its owner only.

    Refuses to overwrite either file: replacing a signing key by accident would make every edge
    box that trusts the old public key refuse new bundles.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private_path, public_path = Path(private_path), Path(public_path)
    for path in (private_path, public_path):
        if path.exists():
            raise EdgeError(f"{path}: already exists; refusing to overwrite a key, remove it first")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    # O_EXCL + 0600: the private key is never readable by others, not even for an instant.
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private_pem)
    public_path.write_bytes(public_pem)


def sign_manifest(manifest: dict[str, Any], private_key_path: Path) -> str:
    """Base64 Ed25519 signature of the manifest (deterministic for a given key and manifest)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = _load_pem(
        private_key_path, "signing", lambda pem: serialization.load_pem_private_key(pem, None)
    )
    if not isinstance(key, Ed25519PrivateKey):
        raise EdgeError(f"signing key {private_key_path}: not an Ed25519 private key")
    return base64.b64encode(key.sign(signed_payload(manifest))).decode("ascii")


def verify_manifest(manifest: dict[str, Any], public_key_path: Path) -> None:
    """Raise EdgeError unless the manifest carries a valid signature by the given public key."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key = _load_pem(public_key_path, "public", serialization.load_pem_public_key)
    if not isinstance(key, Ed25519PublicKey):
        raise EdgeError(f"public key {public_key_path}: not an Ed25519 public key")
    encoded = manifest.get(SIGNATURE_FIELD)
    if not encoded:
        raise EdgeError(
            f"manifest.json is not signed but --public-key {public_key_path} requires a "
            "signature; refusing to activate; publish the bundle with the signing key"
        )
    try:
        signature = base64.b64decode(str(encoded), validate=True)
        key.verify(signature, signed_payload(manifest))
    except (ValueError, InvalidSignature):
        raise EdgeError(
            f"manifest.json: signature does not verify with {public_key_path} (tampered, or "
            "signed with another key); refusing to activate"
        ) from None


def _load_pem(path: Path, kind: str, loader: Callable[[bytes], Any]) -> Any:
    try:
        pem = Path(path).read_bytes()
    except OSError as exc:
        raise EdgeError(f"{kind} key {path}: cannot read ({exc.strerror})") from None
    try:
        return loader(pem)
    except (ValueError, TypeError):
        raise EdgeError(
            f"{kind} key {path}: not a PEM key (or it is password-protected); "
            "use the files written by `realloop-edge keygen`"
        ) from None
