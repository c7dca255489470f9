"""The prefix-cache salt of a request under an adapter: KV computed under one adapter never serves another."""

from __future__ import annotations

import json

from pagoda.server.lora.request import LoRARequest


def lora_salt(salt: str | None, lora: LoRARequest | None) -> str | None:
    """`salt` with the adapter (id, name and folder) folded in; `salt` itself for the base model.

    The scheduler hashes the salt into a sequence's first block, so every block chains to it (like cache_salt).
    """
    if lora is None:
        return salt
    return json.dumps(["lora", lora.lora_int_id, lora.lora_name, lora.lora_path, salt], separators=(",", ":"))
