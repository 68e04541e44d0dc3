"""Swarm admission: who may talk to a private swarm's nodes, proved before any other protocol.

Theory of operation
-------------------
A private swarm shares one secret, the *swarm key*. Noise already proves each side's peer id;
admission proves that the peer also holds the key, on every new connection, before any other
protocol is served or used:

* As soon as the first connection to a peer opens, each side *challenges* the other on
  ``/peerinfer/admit/1.0.0``: the verifier ``V`` sends a fresh random nonce ``n`` (32 bytes) and
  the prover ``P`` answers ``HMAC(K, label || V || P || n)``, where ``K`` is derived from the swarm
  key and ``V``, ``P`` are the two (Noise-authenticated) peer ids. The proof binds the verifier,
  the prover and the verifier's nonce, so it cannot be replayed, reflected back at its sender or
  relayed from another member's connection. Both sides challenge, so admission is mutual.
* Until a peer's proof has checked out, the host serves it nothing: every stream handler and the
  gossip layer wait (at most ``admission_timeout_s``) for the verdict; our own streams to it wait
  too. A wrong proof, a peer that does not speak the protocol (an open-swarm node) or one that
  stays silent past the deadline is refused: its connections are closed, the refusal logged once
  per peer, and a ``connect`` to it fails with ``PeerUnavailableError`` naming the reason. A wrong
  key is detected after one round trip (milliseconds on a LAN), not at a dial timeout.

Why not py-libp2p's pre-shared-key transport (``new_host(psk=...)``)? It XORs the TCP stream
with a Salsa20 keystream before Noise; with a mismatched key both ends read garbage and wait for
a length prefix that never completes, so a refusal takes the whole upgrade timeout, and neither
side learns who was refused or why (the peer id is unknown before Noise). Its nonce handling also
differs from the libp2p pnet spec. This handshake costs one round trip per connection.

Invites
-------
``make_invite(key, addrs)`` packs a swarm key and the bootstrap addresses of one member into one
string, ``peerinfer-invite:1:<key>:<multiaddr>[,<multiaddr>...]``; ``parse_invite`` unpacks it.
The invite contains the key: treat it like the key (a file or an environment variable, not a
command line that other users of the machine can read with ``ps``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from peerinfer.errors import ConfigError

ADMIT_PROTOCOL = "/peerinfer/admit/1.0.0"
NONCE_BYTES = 32
PROOF_BYTES = 32
_LABEL = b"peerinfer/admit/1"
INVITE_PREFIX = "peerinfer-invite:1:"
#: Swarm keys made by ``new_swarm_key``: 32 random bytes, hex.
SWARM_KEY_BYTES = 32


def admission_key(swarm_key: bytes) -> bytes:
    """The HMAC key of the handshake, derived so it is never the digest key itself."""
    if not swarm_key:
        raise ConfigError("the swarm key is empty")
    return hashlib.blake2b(swarm_key, digest_size=32, person=b"peerinfer-admit").digest()


def proof(key: bytes, verifier: str, prover: str, nonce: bytes) -> bytes:
    """What ``prover`` answers to ``verifier``'s challenge ``nonce``."""
    message = b"\x00".join((_LABEL, verifier.encode(), prover.encode(), nonce))
    return hmac.new(key, message, hashlib.sha256).digest()


def check_proof(key: bytes, verifier: str, prover: str, nonce: bytes, answer: bytes) -> bool:
    return hmac.compare_digest(proof(key, verifier, prover, nonce), answer)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def new_swarm_key() -> str:
    """A fresh swarm key as text (64 hex digits)."""
    return secrets.token_hex(SWARM_KEY_BYTES)


def make_invite(swarm_key: str, addrs: list[str] | tuple[str, ...]) -> str:
    """One string holding the key and a member's dialable addresses (with ``/p2p/<id>``)."""
    if not swarm_key or ":" in swarm_key or any(c.isspace() for c in swarm_key):
        raise ConfigError("a swarm key in an invite must be non-empty, without ':' or spaces")
    if not addrs or any("/p2p/" not in a or "," in a for a in addrs):
        raise ConfigError("an invite needs at least one address ending in /p2p/<peer id>")
    return INVITE_PREFIX + swarm_key + ":" + ",".join(addrs)


def invite_address(addr: str, port: int) -> str:
    """An address given to ``peerinfer swarm new --addr`` as an invite carries it: a bare host
    (``/ip4/1.2.3.4``, ``/dns4/home.example``) gets ``/tcp/<port>``; an address that is not
    TCP or ends in ``/p2p/<id>`` is a ConfigError now, since an invite nobody can dial fails
    only later, on the joiner's side, in a loop of "no transport found"."""
    parts = addr.strip().rstrip("/").split("/")
    if len(parts) < 3 or parts[0] != "" or parts[-2] == "p2p":
        raise ConfigError(f"--addr {addr!r}: expected a multiaddr without /p2p, like /ip4/1.2.3.4/tcp/{port}")
    if len(parts) == 3 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return f"{'/'.join(parts)}/tcp/{port}"
    if "tcp" not in parts[3:-1]:
        raise ConfigError(f"--addr {addr!r}: peerinfer nodes listen on TCP; expected like /ip4/1.2.3.4/tcp/{port}")
    return "/".join(parts)


def parse_invite(text: str) -> tuple[str, tuple[str, ...]]:
    """``(swarm key, bootstrap addresses)`` from an invite; ``ConfigError`` if it is not one."""
    text = text.strip()
    if not text.startswith(INVITE_PREFIX):
        raise ConfigError(f"not a peerinfer invite (expected it to start with {INVITE_PREFIX!r})")
    key, sep, addrs = text[len(INVITE_PREFIX):].partition(":")
    parts = tuple(a for a in addrs.split(",") if a)
    if not key or not sep or not parts or any("/p2p/" not in a for a in parts):
        raise ConfigError("a malformed invite: expected peerinfer-invite:1:<key>:<multiaddr>[,...]")
    return key, parts


__all__ = [
    "ADMIT_PROTOCOL",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "admission_key",
    "check_proof",
    "invite_address",
    "make_invite",
    "new_nonce",
    "new_swarm_key",
    "parse_invite",
    "proof",
]
