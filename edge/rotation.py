"""Making and rotating the channel's keys (`realloop keys init` / `realloop keys rotate`).

Root rotation follows TUF: root N+1 is signed by the old and the new root key, so an enrolled
box, trusting root N, verifies N+1 and from then on trusts the new key only. Rotating an online
top-level key (timestamp, snapshot, targets) is a root change too (root lists those keys), then
the role is re-signed with its new key. A cell's key is listed by the targets role, so rotating
it re-signs targets (the delegation) and the cell's metadata. Both need the root key only when
root changes: rotating a cell key needs the online keys alone.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from tuf.api.metadata import Metadata, Root, Targets

from edge import keys
from edge.channels import open_channel
from edge.errors import EdgeError
from edge.tuf_repo import ROOT_EXPIRY, Repository, new_root, now_utc, publishing


def init_keys(keys_dir: Path, channel_uri: str | None, timestamp_expiry_s: float) -> dict:
    """Every key, root.json, and (with a channel) the channel's first metadata."""
    keys_dir = Path(keys_dir)
    made = []
    if not (keys_dir / keys.ROOT_METADATA).exists():
        for role in (*keys.TOP_ROLES, keys.GATE):
            keys.generate_key(keys_dir, role)
            made.append(role)
        root = new_root(keys_dir)
        _write_root(keys_dir, root)
    result: dict[str, Any] = {
        "keys": str(keys_dir),
        "made": made,
        "root": str(keys_dir / keys.ROOT_METADATA),
        "offline": str(keys_dir / keys.OFFLINE_DIR),
    }
    if channel_uri is not None:
        result["channel"] = str(channel_uri)
        result["timestamp_version"] = init_channel(keys_dir, channel_uri, timestamp_expiry_s)
    return result


def init_channel(keys_dir: Path, channel_uri: str, timestamp_expiry_s: float) -> int | None:
    """The channel's first metadata (root, targets with gate-keys.json, snapshot, timestamp);
    nothing when it already has some. Needs only the online keys and root.json."""
    with publishing(keys_dir):
        repo = Repository(open_channel(channel_uri), keys_dir, timestamp_expiry_s)
        if repo.timestamp is not None:
            return None
        repo.ensure_top_targets()
        return repo.commit()


def rotate_key(
    keys_dir: Path, role: str, channel_uri: str, timestamp_expiry_s: float
) -> dict[str, Any]:
    """A new key for `role` (root, timestamp, snapshot, targets, gate or a cell id), written
    to the channel so enrolled boxes follow it."""
    keys_dir = Path(keys_dir)
    if role in keys.TOP_ROLES:  # root changes: say first if its key is not here
        keys.load_signer(keys_dir, keys.ROOT)
    old = keys.load_public(keys.public_path(keys_dir, role))
    with publishing(keys_dir):
        repo = Repository(open_channel(channel_uri), keys_dir, timestamp_expiry_s)
        if repo.timestamp is None:
            raise EdgeError(f"{channel_uri}: no metadata yet; run `realloop keys init --channel`")
        if role in keys.TOP_ROLES:
            old_root_signer = keys.load_signer(keys_dir, keys.ROOT)
            new = keys.generate_key(keys_dir, role, replace=True)
            root = copy.deepcopy(repo.root)  # to_dict shares lists: edit a real copy
            root.signed.revoke_key(old.keyid, role)
            root.signed.add_key(new.public_key, role)
            root.signed.version += 1
            root.signed.expires = now_utc() + ROOT_EXPIRY
            root.signatures.clear()
            root.sign(keys.load_signer(keys_dir, keys.ROOT), append=True)
            if role == keys.ROOT:  # the old root vouches for the new one
                root.sign(old_root_signer, append=True)
            if role == Targets.type:  # loaded (and verified) under the old root first
                repo.rekey(Targets.type)
            _write_root(keys_dir, root)
            repo.replace_root(root)
        elif role == keys.GATE:
            keys.generate_key(keys_dir, role, replace=True)
            repo.put_gate_keys()
        else:
            if repo.targets(role) is None:
                raise EdgeError(f"cell {role!r}: never released on {channel_uri}; no key to rotate")
            # Loaded (and verified) under the old delegation first, then re-keyed.
            repo.rekey(Targets.type)
            repo.rekey(role)
            new = keys.generate_key(keys_dir, role, replace=True)
            top = repo.targets(Targets.type)
            top.signed.revoke_key(old.keyid, role)
            top.signed.add_key(new.public_key, role)
        version = repo.commit()
    new_key = keys.load_public(keys.public_path(keys_dir, role))
    return {
        "role": role,
        "old_keyid": old.keyid,
        "new_keyid": new_key.keyid,
        "root_version": repo.root.signed.version,
        "timestamp_version": version,
        "channel": str(channel_uri),
    }


def _write_root(keys_dir: Path, root: Metadata[Root]) -> None:
    from tuf.api.serialization.json import JSONSerializer

    path = Path(keys_dir) / keys.ROOT_METADATA
    temp = path.with_name(f".{path.name}.new")
    temp.write_bytes(root.to_bytes(JSONSerializer(compact=False)))
    temp.replace(path)
