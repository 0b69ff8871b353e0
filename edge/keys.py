"""The signing keys of a release channel, as files in one keys folder.

```
DIR/offline/root.key        root: signs root metadata only (init, rotations). Keep it off the
                            publisher: copy it to offline storage after `realloop keys init`
DIR/online/timestamp.key    online keys, used by every promotion
DIR/online/snapshot.key
DIR/online/targets.key      delegates `<cell>/*` to each cell's key, signs gate-keys.json
DIR/online/gate.key         signs gate attestations (the gate stage only)
DIR/online/cells/<cell>.key one per cell, made when the cell is first released to
DIR/root.json               the signed root metadata, the file a box is enrolled with
```
Each `*.key` is an Ed25519 private key (PEM, PKCS8, mode 0600); `*.pub.json` next to it is the
public key in TUF's key format.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from securesystemslib.signer import CryptoSigner, Key, SSlibKey

from edge.bundle import check_name
from edge.errors import EdgeError

OFFLINE_DIR = "offline"
ONLINE_DIR = "online"
CELLS_DIR = "cells"
ROOT_METADATA = "root.json"
ROOT = "root"
TOP_ROLES = ("root", "timestamp", "snapshot", "targets")
GATE = "gate"
ONLINE_ROLES = ("timestamp", "snapshot", "targets", GATE)


def key_path(keys_dir: Path, role: str) -> Path:
    """Where `role`'s private key lives: root offline, the others online, cells under cells/."""
    keys_dir = Path(keys_dir)
    if role == ROOT:
        return keys_dir / OFFLINE_DIR / "root.key"
    if role in ONLINE_ROLES:
        return keys_dir / ONLINE_DIR / f"{role}.key"
    return keys_dir / ONLINE_DIR / CELLS_DIR / f"{check_name(role, 'cell id')}.key"


def public_path(keys_dir: Path, role: str) -> Path:
    return key_path(keys_dir, role).with_suffix(".pub.json")


def generate_key(keys_dir: Path, role: str, *, replace: bool = False) -> CryptoSigner:
    """A new Ed25519 key for `role`, written 0600 (never readable by others, not even briefly).

    Refuses to overwrite unless `replace` (a rotation): losing a key by accident would make
    every box that trusts it refuse new releases.
    """
    path = key_path(keys_dir, role)
    if path.exists() and not replace:
        raise EdgeError(f"{path}: already exists; refusing to overwrite a key (rotate it instead)")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    signer = CryptoSigner.generate_ed25519()
    temp = path.with_name(f".{path.name}.new")
    temp.unlink(missing_ok=True)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(signer.private_bytes)
    public = json.dumps(key_document(signer.public_key), indent=2, sort_keys=True) + "\n"
    public_path(keys_dir, role).write_text(public, encoding="utf-8")
    os.replace(temp, path)
    return signer


def load_signer(keys_dir: Path, role: str) -> CryptoSigner:
    """`role`'s signer from the keys folder; a one-line error naming the file when absent."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    path = key_path(keys_dir, role)
    try:
        pem = path.read_bytes()
    except FileNotFoundError:
        hint = (
            "root is an offline key: bring DIR/offline back for this operation"
            if role == ROOT
            else "run `realloop keys init` first (promote.keys in params.yaml names the folder)"
        )
        raise EdgeError(f"{path}: no {role} key; {hint}") from None
    except OSError as exc:
        raise EdgeError(f"{path}: cannot read the {role} key ({exc.strerror})") from None
    try:
        private = load_pem_private_key(pem, None)
    except (ValueError, TypeError):
        raise EdgeError(f"{path}: not an unencrypted PEM private key") from None
    return CryptoSigner(private, load_public(public_path(keys_dir, role)))


def load_public(path: Path) -> Key:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return SSlibKey.from_dict(data["keyid"], {k: v for k, v in data.items() if k != "keyid"})
    except FileNotFoundError:
        raise EdgeError(f"{path}: public key missing; the keys folder is incomplete") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise EdgeError(f"{path}: not a public key file ({exc})") from None


def key_document(key: Key) -> dict:
    """A public key as JSON with its keyid (what *.pub.json and gate-keys.json hold)."""
    return {"keyid": key.keyid, **key.to_dict()}
