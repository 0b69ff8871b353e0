"""The publisher's side of the signed channel: a TUF repository written through a `Channel`.

```
<channel>/tuf/metadata/<N>.root.json            root versions (a box walks them to rotate)
<channel>/tuf/metadata/<N>.targets.json         delegates `<cell>/*` to each cell's key
<channel>/tuf/metadata/<N>.<cell>.json          the cell's current release, signed by its key
<channel>/tuf/metadata/<N>.snapshot.json        versions of every targets role
<channel>/tuf/metadata/timestamp.json           the snapshot's version and hash: the publish
<channel>/tuf/targets/<dir>/<sha256>.<name>     target files, content-addressed
```
Consistent snapshots: every file but timestamp.json is immutable once the timestamp names it,
so a publish writes targets, then the cell's metadata, then the snapshot, and last the
timestamp, one atomic write (a PUT on S3, os.replace on a folder) that makes it all visible.
A publish killed before that leaves files nobody references; the next one overwrites them.
Publishers sharing a keys folder take turns (a lock file in it): snapshot versions must not fork.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from securesystemslib.signer import Signer
from tuf.api.exceptions import LengthOrHashMismatchError, UnsignedMetadataError
from tuf.api.metadata import (
    DelegatedRole,
    Delegations,
    Metadata,
    MetaFile,
    Root,
    Snapshot,
    TargetFile,
    Targets,
    Timestamp,
)
from tuf.api.serialization import DeserializationError
from tuf.api.serialization.json import JSONSerializer

from edge import keys
from edge.bundle import check_name
from edge.channel import Channel
from edge.errors import EdgeError, KeyNotFoundError

METADATA_PREFIX = "tuf/metadata/"
TARGETS_PREFIX = "tuf/targets/"
GATE_KEYS_TARGET = "gate-keys.json"
RELEASE_NAME = "release.json"
ATTESTATION_NAME = "attestation.json"
# Re-signed by every publish; only the timestamp must be fresh for a box to trust the channel.
ROLE_EXPIRY = timedelta(days=365)
ROOT_EXPIRY = timedelta(days=5 * 365)
_SERIALIZER = JSONSerializer(compact=False)
TIMESTAMPS_FILE = ".timestamp-versions.json"  # in the keys folder: versions written per channel


def release_target(cell_id: str) -> str:
    return f"{check_name(cell_id, 'cell id')}/{RELEASE_NAME}"


def bundle_target(cell_id: str, bundle_id: str, name: str) -> str:
    return f"{check_name(cell_id, 'cell id')}/{check_name(bundle_id, 'bundle id')}/{name}"


def cell_paths(cell_id: str) -> list[str]:
    # A `*` never matches '/' in TUF: one pattern per depth, nothing outside the cell's folder.
    return [f"{cell_id}/*", f"{cell_id}/*/*"]


def new_root(keys_dir: Path) -> Metadata[Root]:
    """Root version 1 over the keys folder's keys, signed by the root key (init only)."""
    root = Root(expires=now_utc() + ROOT_EXPIRY, consistent_snapshot=True)
    for role in keys.TOP_ROLES:
        root.add_key(keys.load_public(keys.public_path(keys_dir, role)), role)
    metadata = Metadata(root)
    metadata.sign(keys.load_signer(keys_dir, keys.ROOT))
    return metadata


class Repository:
    """The repository as the channel holds it, checked against the keys folder's root."""

    def __init__(self, channel: Channel, keys_dir: Path, timestamp_expiry_s: float) -> None:
        self.channel = channel
        self.keys_dir = Path(keys_dir)
        self.timestamp_expiry = timedelta(seconds=timestamp_expiry_s)
        self.root = _trusted_root(self.keys_dir)
        self._changed: dict[str, Metadata[Targets]] = {}
        self.snapshot: Metadata[Snapshot] | None = None
        self.timestamp: Metadata[Timestamp] | None = None
        self._load()

    # --- reading -----------------------------------------------------------------------------

    def _load(self) -> None:
        self._listed = self._listed_versions()
        on_channel = self._latest_root_version()
        mine = self.root.signed.version
        if on_channel > mine:
            raise EdgeError(
                f"{self._describe(f'{on_channel}.root.json')}: the channel's root is version "
                f"{on_channel}, the keys folder's root.json is {mine}; use the keys folder the "
                "channel was last rotated with"
            )
        # A fresh channel, or a rotation not yet written to it: the commit writes root first.
        self._root_to_write = on_channel < mine
        try:
            self.timestamp = self._read("timestamp.json", Timestamp.type)
        except KeyNotFoundError:
            return  # an empty repository: the first publish writes everything
        meta = self.timestamp.signed.snapshot_meta
        self.snapshot = self._read(f"{meta.version}.snapshot.json", Snapshot.type)

    def targets(self, role: str) -> Metadata[Targets] | None:
        """`role`'s current targets metadata (as changed so far in this publish)."""
        if role in self._changed:
            return self._changed[role]
        if self.snapshot is None or f"{role}.json" not in self.snapshot.signed.meta:
            return None
        version = self.snapshot.signed.meta[f"{role}.json"].version
        return self._read(f"{version}.{role}.json", role)

    def current_release(self, cell_id: str) -> dict[str, Any] | None:
        """The release description the cell's role names now, None before the first."""
        data = self.target_bytes(cell_id, release_target(cell_id))
        return None if data is None else json.loads(data)

    def target_bytes(self, role: str, path: str) -> bytes | None:
        """The bytes `role` lists at `path` now (hash checked), None when it lists none."""
        metadata = self.targets(role)
        info = metadata.signed.targets.get(path) if metadata else None
        if info is None:
            return None
        data = self.channel.get_bytes(_target_key(info))
        info.verify_length_and_hashes(data)
        return data

    def _read(self, name: str, role: str) -> Metadata:
        key = METADATA_PREFIX + name
        data = self.channel.get_bytes(key)
        try:
            metadata = Metadata.from_bytes(data)
        except DeserializationError as exc:
            raise EdgeError(f"{self._describe(name)}: not TUF metadata ({exc})") from None
        self._verify(role, metadata, name)
        return metadata

    def _verify(self, role: str, metadata: Metadata, name: str) -> None:
        # Never sign over what someone else wrote: it must verify with our own keys first.
        delegator = self.root.signed
        if role not in keys.TOP_ROLES:
            delegator = self.targets(Targets.type).signed
        try:
            delegator.verify_delegate(role, metadata.signed_bytes, metadata.signatures)
        except (UnsignedMetadataError, ValueError) as exc:
            raise EdgeError(
                f"{self._describe(name)}: does not verify with this keys folder's {role} key "
                f"({exc}); someone else wrote to the channel: refusing to sign over it"
            ) from None

    def _latest_root_version(self) -> int:
        return self._listed.get(Root.type, 0)

    def _listed_versions(self) -> dict[str, int]:
        """The highest `<N>.<role>.json` on the channel per role."""
        highest: dict[str, int] = {}
        for key in self.channel.list(METADATA_PREFIX):
            number, _, rest = key[len(METADATA_PREFIX) :].partition(".")
            if number.isdigit() and rest.endswith(".json"):
                role = rest.removesuffix(".json")
                highest[role] = max(highest.get(role, 0), int(number))
        return highest

    def _next_version(self, role: str, current: int) -> int:
        """One above both what this builds on and any file of the role on the channel: a
        replayed old timestamp (an attack) or a publish killed halfway must never make this
        write a version a box has already seen."""
        return max(current, self._listed.get(role, 0)) + 1

    # --- changing ------------------------------------------------------------------------------

    def ensure_top_targets(self) -> Metadata[Targets]:
        """The top-level targets role, created with gate-keys.json on an empty repository."""
        current = self.targets(Targets.type)
        if current is not None:
            return current
        top = Targets(expires=now_utc() + ROLE_EXPIRY, delegations=Delegations(keys={}, roles={}))
        metadata = Metadata(top)
        self._changed[Targets.type] = metadata
        self.put_gate_keys()
        return metadata

    def put_gate_keys(self) -> None:
        """gate-keys.json (the gate's public key), a target signed by the targets role."""
        gate = keys.load_public(keys.public_path(self.keys_dir, keys.GATE))
        document = {"keys": [keys.key_document(gate)], "threshold": 1}
        data = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
        self.set_target(Targets.type, GATE_KEYS_TARGET, data)

    def ensure_cell(self, cell_id: str) -> None:
        """Delegate `<cell>/*` to the cell's own key, made on its first release."""
        top = self._editable(Targets.type)
        delegations = top.signed.delegations
        assert delegations is not None and delegations.roles is not None
        if cell_id in delegations.roles:
            return
        path = keys.key_path(self.keys_dir, cell_id)
        signer = keys.load_signer(self.keys_dir, cell_id) if path.exists() else None
        signer = signer or keys.generate_key(self.keys_dir, cell_id)
        delegations.roles[cell_id] = DelegatedRole(
            cell_id, [], 1, terminating=True, paths=cell_paths(cell_id)
        )
        top.signed.add_key(signer.public_key, cell_id)
        self._changed[cell_id] = Metadata(Targets(expires=now_utc() + ROLE_EXPIRY))

    def set_target(self, role: str, path: str, data: bytes) -> TargetFile:
        """Upload `data` content-addressed and list it under `path` in `role`."""
        info = TargetFile.from_data(path, data, ["sha256"])
        self.channel.put_bytes(_target_key(info), data)
        self._editable(role).signed.targets[path] = info
        return info

    def set_target_file(self, role: str, path: str, local: Path) -> TargetFile:
        info = TargetFile.from_file(path, str(local), ["sha256"])
        self.channel.put_file(_target_key(info), Path(local))
        self._editable(role).signed.targets[path] = info
        return info

    def clear_targets(self, role: str, keep: Collection[str] = ()) -> None:
        """Unlist every target of `role` but the paths in `keep`."""
        targets = self._editable(role).signed.targets
        for path in [p for p in targets if p not in keep]:
            del targets[path]

    def replace_root(self, root: Metadata[Root]) -> None:
        """A rotated root (already signed): the next commit writes it before anything else."""
        self.root = root
        self._root_to_write = True

    def rekey(self, role: str) -> None:
        """Mark `role` changed so the commit re-signs it (with a rotated key)."""
        self._editable(role)

    def _editable(self, role: str) -> Metadata[Targets]:
        if role not in self._changed:
            current = self.targets(role)
            if current is None:
                raise EdgeError(f"targets role {role!r}: not on the channel yet")
            self._changed[role] = current
        return self._changed[role]

    def commit(self) -> int:
        """Sign and write the changed roles, then the snapshot, then (last) the timestamp;
        return the timestamp's version."""
        if self._root_to_write:
            self._put_metadata(f"{self.root.signed.version}.root.json", self.root)
            self._root_to_write = False
        snapshot = self.snapshot.signed if self.snapshot else Snapshot(meta={})
        for role, metadata in self._changed.items():
            previous = snapshot.meta.get(f"{role}.json")
            metadata.signed.version = self._next_version(role, previous.version if previous else 0)
            metadata.signed.expires = now_utc() + ROLE_EXPIRY
            self._sign(metadata, role)
            self._put_metadata(f"{metadata.signed.version}.{role}.json", metadata)
            snapshot.meta[f"{role}.json"] = MetaFile(version=metadata.signed.version)
        new_snapshot = Metadata(snapshot)
        snapshot.version = self._next_version(
            Snapshot.type, self.snapshot.signed.version if self.snapshot else 0
        )
        snapshot.expires = now_utc() + ROLE_EXPIRY
        self._sign(new_snapshot, Snapshot.type)
        snapshot_bytes = self._put_metadata(f"{snapshot.version}.snapshot.json", new_snapshot)
        # The timestamp carries the snapshot's hash: a swapped snapshot file is refused.
        timestamp = Timestamp(
            version=self._next_timestamp_version(),
            expires=now_utc() + self.timestamp_expiry,
            snapshot_meta=MetaFile.from_data(snapshot.version, snapshot_bytes, ["sha256"]),
        )
        new_timestamp = Metadata(timestamp)
        self._sign(new_timestamp, Timestamp.type)
        self._put_metadata("timestamp.json", new_timestamp)
        self._remember_timestamp(timestamp.version)
        self.snapshot, self.timestamp, self._changed = new_snapshot, new_timestamp, {}
        return timestamp.version

    def refresh_timestamp(self) -> int:
        """A new timestamp over the same snapshot: keeps boxes trusting an idle channel."""
        if self.snapshot is None or self.timestamp is None:
            raise EdgeError(f"{self.channel.uri}: nothing published yet; nothing to refresh")
        timestamp = self.timestamp.signed
        timestamp.version = self._next_timestamp_version()
        timestamp.expires = now_utc() + self.timestamp_expiry
        self._sign(self.timestamp, Timestamp.type)
        self._put_metadata("timestamp.json", self.timestamp)
        self._remember_timestamp(timestamp.version)
        return timestamp.version

    def _next_timestamp_version(self) -> int:
        # timestamp.json is the one file rewritten in place, so its history is not listed:
        # the keys folder remembers the highest version written per channel.
        current = self.timestamp.signed.version if self.timestamp else 0
        return max(current, self._timestamps().get(self.channel.uri, 0)) + 1

    def _timestamps(self) -> dict[str, int]:
        try:
            return json.loads((self.keys_dir / TIMESTAMPS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def _remember_timestamp(self, version: int) -> None:
        path = self.keys_dir / TIMESTAMPS_FILE
        seen = self._timestamps() | {self.channel.uri: version}
        temp = path.with_name(f".{path.name}.tmp")
        temp.write_text(json.dumps(seen, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        temp.replace(path)

    def _sign(self, metadata: Metadata, role: str) -> None:
        signer: Signer = keys.load_signer(self.keys_dir, role)
        metadata.signatures.clear()
        metadata.sign(signer, append=True)

    def _put_metadata(self, name: str, metadata: Metadata) -> bytes:
        data = metadata.to_bytes(_SERIALIZER)
        self.channel.put_bytes(METADATA_PREFIX + name, data)
        return data

    def _describe(self, name: str) -> str:
        return self.channel.describe(METADATA_PREFIX + name)


def named_release(channel: Channel, cell_id: str) -> dict[str, Any] | None:
    """The release the channel's current metadata names for `cell_id`, None before the first.

    For the publisher's own bookkeeping (the incumbent of a trial, status lines): it follows
    timestamp, snapshot and the cell's role and checks the release's hash, but not signatures;
    an edge box trusts nothing before ngclient verified it (edge.tuf_client).
    """
    data = named_target(channel, cell_id, release_target(cell_id))
    return None if data is None else json.loads(data)


def named_target(channel: Channel, cell_id: str, path: str) -> bytes | None:
    """The bytes the cell's role lists at `path` now, unverified like `named_release`."""
    try:
        timestamp = Metadata.from_bytes(channel.get_bytes(METADATA_PREFIX + "timestamp.json"))
        meta = timestamp.signed.snapshot_meta
        snapshot = Metadata.from_bytes(
            channel.get_bytes(f"{METADATA_PREFIX}{meta.version}.snapshot.json")
        )
        role = snapshot.signed.meta.get(f"{check_name(cell_id, 'cell id')}.json")
        if role is None:
            return None
        cell = Metadata.from_bytes(
            channel.get_bytes(f"{METADATA_PREFIX}{role.version}.{cell_id}.json")
        )
        info = cell.signed.targets.get(path)
        if info is None:
            return None
        data = channel.get_bytes(_target_key(info))
        info.verify_length_and_hashes(data)
    except KeyNotFoundError:
        return None
    except (DeserializationError, LengthOrHashMismatchError) as exc:
        raise EdgeError(
            f"{channel.uri}: the metadata of {cell_id} is inconsistent ({exc})"
        ) from None
    return data


def _trusted_root(keys_dir: Path) -> Metadata[Root]:
    path = Path(keys_dir) / keys.ROOT_METADATA
    try:
        return Metadata[Root].from_bytes(path.read_bytes())
    except FileNotFoundError:
        raise EdgeError(f"{path}: no root metadata; run `realloop keys init {keys_dir}`") from None
    except DeserializationError as exc:
        raise EdgeError(f"{path}: not TUF root metadata ({exc})") from None


def _target_key(info: TargetFile) -> str:
    directory, sep, name = info.path.rpartition("/")
    return f"{TARGETS_PREFIX}{directory}{sep}{info.hashes['sha256']}.{name}"


def now_utc() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


@contextmanager
def publishing(keys_dir: Path) -> Iterator[None]:
    """One publisher at a time per keys folder (blocking: a publish takes a second)."""
    Path(keys_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(keys_dir) / ".publish.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
