"""The node's persistent identity: one Ed25519 key, its peer id derived from the public key.

Format: libp2p's protobuf private-key encoding (what ``libp2p.identity_utils.save_identity``
writes), so the file is interchangeable with other libp2p tools.

Creation is race-free and crash-safe: the key is written to a private temporary file in the
same directory (mode 0600 from the start), fsynced, and hard-linked into place; ``link`` fails
if another process won the race, and then we load the winner's key. A partially written key can
never appear under the final name. A key readable by group or others is refused
(``ConfigError``) rather than silently used, as ssh does.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from peerinfer.errors import ConfigError

logger = logging.getLogger(__name__)


def new_identity() -> KeyPair:
    """A fresh random Ed25519 key pair (nothing written)."""
    return create_new_key_pair()


def peer_id_of(key_pair: KeyPair) -> str:
    """The base58 peer id (``12D3KooW...``) of a key pair."""
    return ID.from_pubkey(key_pair.public_key).to_base58()


def _load(path: Path) -> KeyPair:
    mode = path.stat().st_mode
    if os.name != "nt" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"identity key {path} is accessible by other users (mode {stat.filemode(mode)}); "
            f"run `chmod 600 {path}`"
        )
    try:
        private_key = deserialize_private_key(path.read_bytes())
        public_key = private_key.get_public_key()
        public_key.serialize()
    except Exception as exc:  # protobuf/cryptography raise many types; all mean "corrupt"
        raise ConfigError(f"identity key {path} is corrupt or not a libp2p private key") from exc
    return KeyPair(private_key, public_key)


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_pair = new_identity()
    fd, tmp_name = tempfile.mkstemp(prefix=".identity-", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(key_pair.private_key.serialize())
            tmp.flush()
            os.fsync(tmp.fileno())
        try:
            os.link(tmp_name, path)
            logger.info("created a new identity %s at %s", peer_id_of(key_pair), path)
        except FileExistsError:
            pass  # another process created it first; we load theirs
    finally:
        os.unlink(tmp_name)


def load_or_create_identity(path: Path) -> KeyPair:
    """Load the key at ``path``, creating it (0600) first if it does not exist."""
    try:
        if not path.exists():
            _create(path)
        return _load(path)
    except OSError as exc:
        raise ConfigError(f"cannot read or create the identity key {path}: {exc}") from exc


__all__ = ["load_or_create_identity", "new_identity", "peer_id_of"]
