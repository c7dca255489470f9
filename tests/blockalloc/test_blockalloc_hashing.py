"""Prefix-cache hashes: sha256 chained over parent hash, token ids and salt; stable across processes."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

from pagoda.blockalloc import BlockHash, hash_block_tokens
from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, hash_blocks, salt_bytes


def test_hash_is_sha256_of_parent_tokens_and_salt() -> None:
    """The digest is sha256 over the parent hash, int64 token ids and the encoded salt."""
    tokens = [1, 2, 262143, 0]
    expected = hashlib.sha256(ROOT_BLOCK_HASH + struct.pack("=4q", *tokens) + b"\x01abc").digest()
    assert hash_block_tokens(ROOT_BLOCK_HASH, tokens, salt_bytes("abc")) == expected
    assert len(expected) == 32


def test_chaining_salt_and_tokens_all_matter() -> None:
    """Equal tokens hash apart under a different parent, salt or token order."""
    root = ROOT_BLOCK_HASH
    base = hash_block_tokens(root, [1, 2], salt_bytes(None))
    assert hash_block_tokens(base, [1, 2], salt_bytes(None)) != base
    assert hash_block_tokens(root, [2, 1], salt_bytes(None)) != base
    assert len({salt_bytes(None), salt_bytes(""), salt_bytes("a")}) == 3
    assert hash_block_tokens(root, [1, 2], salt_bytes("")) != base


def test_hash_blocks_matches_one_at_a_time() -> None:
    """hash_blocks chains exactly like repeated hash_block_tokens, starting at any block."""
    tokens = list(range(20))
    salt = salt_bytes("s")
    parent = ROOT_BLOCK_HASH
    one_by_one: list[BlockHash] = []
    for start in range(0, 16, 4):
        parent = hash_block_tokens(parent, tokens[start : start + 4], salt)
        one_by_one.append(parent)
    assert hash_blocks(tokens, 4, 0, 4, ROOT_BLOCK_HASH, salt) == one_by_one
    assert hash_blocks(tokens, 4, 2, 4, one_by_one[1], salt) == one_by_one[2:]
    assert hash_blocks(tokens, 4, 3, 3, one_by_one[1], salt) == []


def test_hashes_are_stable_across_processes() -> None:
    """Different PYTHONHASHSEED values give the same block hash (Python's hash() is never used)."""
    code = (
        "from pagoda.blockalloc import BlockManager\n"
        "m = BlockManager(4, 2)\n"
        "m.allocate_slots('a', [5, 6], 2, salt='t')\n"
        "print(next(iter(m.pool.cached_block_hash_to_block)).hex())\n"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    expected = hash_block_tokens(ROOT_BLOCK_HASH, [5, 6], salt_bytes("t")).hex() + "\n"
    assert outs == {expected}
