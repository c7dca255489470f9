"""Prefix-cache content hashes: sha256 over the parent block's hash, the block's token ids and a salt."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType, cast

BlockHash = NewType("BlockHash", bytes)
"""sha256 digest naming a full block's content and its whole prefix (never Python's `hash()`)."""

# Parent of a sequence's first block: a fixed value so hashes are reproducible across processes.
ROOT_BLOCK_HASH = BlockHash(hashlib.sha256(b"pagoda.blockalloc root block").digest())


def salt_bytes(salt: str | None) -> bytes:
    """Encode a per-request salt so that no salt, an empty salt and any other salt all hash apart."""
    return b"\x00" if salt is None else b"\x01" + salt.encode()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], salt: bytes) -> BlockHash:
    """Hash of one full block chained with its parent's hash; `salt` comes from `salt_bytes`."""
    # Token ids are packed as fixed-width int64 so that no two token lists share a byte string.
    return BlockHash(hashlib.sha256(parent + array("q", token_ids).tobytes() + salt).digest())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    start_block: int,
    end_block: int,
    parent: BlockHash,
    salt: bytes,
) -> list[BlockHash]:
    """Chained hashes of full blocks `start_block..end_block-1` of `token_ids`, given the parent hash."""
    if end_block <= start_block:
        return []
    # Pack the whole range once, then hash per-block byte slices; measured faster than per-block packing.
    raw = array("q", token_ids[start_block * block_size : end_block * block_size]).tobytes()
    width = block_size * 8  # bytes per block: int64 token ids
    digests: list[bytes] = []
    append = digests.append
    sha256 = hashlib.sha256
    digest: bytes = parent
    for start in range(0, len(raw), width):
        digest = sha256(digest + raw[start : start + width] + salt).digest()
        append(digest)
    # BlockHash is a NewType over bytes: one cast instead of a call per block.
    return cast(list[BlockHash], digests)


class LastChainCache:
    """The last hash chain computed, reused while a token list's leading blocks match: one hash per block."""

    __slots__ = ("block_size", "hashes", "salt", "tokens")

    def __init__(self, block_size: int) -> None:
        """Start empty."""
        self.block_size = block_size
        self.salt = b""
        self.tokens: list[int] = []  # a copy of the hashed tokens: a caller may change its list in place
        self.hashes: list[BlockHash] = []

    def hashes_for(self, token_ids: Sequence[int], num_blocks: int, salt: bytes) -> list[BlockHash]:
        """Chained hashes of the first `num_blocks` full blocks; the result may be shared, so copy to keep it."""
        bs = self.block_size
        hashes: list[BlockHash] = []
        k = min(num_blocks, len(self.hashes))
        if k and salt == self.salt:
            prefix = token_ids[: k * bs]
            # Comparing token ids runs in C and is far cheaper than hashing them again.
            if (prefix if isinstance(prefix, list) else list(prefix)) == (
                self.tokens if k == len(self.hashes) else self.tokens[: k * bs]
            ):
                if k == num_blocks:
                    return self.hashes if k == len(self.hashes) else self.hashes[:k]
                hashes = self.hashes
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
            hashes = hashes + hash_blocks(token_ids, bs, len(hashes), num_blocks, parent, salt)
            self.salt, self.tokens, self.hashes = salt, list(token_ids[: num_blocks * bs]), hashes
        return hashes
