"""The shared vocabulary: small, frozen values used by every layer."""

from __future__ import annotations

from typing import NewType

#: A libp2p peer id in its base58 text form (``12D3KooW...``). The core treats it as opaque.
PeerId = NewType("PeerId", str)

#: A 64-bit keyed chain hash of one block of tokens and everything before it. Because each
#: hash covers its parent, one BlockHash names a whole prefix, not just a block.
BlockHash = NewType("BlockHash", int)

#: An opaque request id, unique per originating node (the origin's peer id is kept beside it).
RequestId = NewType("RequestId", str)

__all__ = ["BlockHash", "PeerId", "RequestId"]
