"""`make_tiny_draft`: a draft model for a tiny model, its copy with a noisy LM head (same vocabulary).

The noise decides how often the draft agrees with the target: 0 makes the model its own draft (greedy drafts
always accepted), a noise of a third of the head's spread has greedy and sampled drafts both often accepted
and often rejected; no noise with a scale below 1 keeps the argmax and flattens the distribution.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def make_tiny_draft(target: Path, path: Path, *, noise: float, scale: float = 1.0, seed: int = 1) -> Path:
    """Copy model folder `target` to `path` with lm_head = scale * lm_head + noise * std(lm_head) * N(0, 1)."""
    shutil.copytree(target, path)
    for file in path.glob("*.safetensors"):
        weights = load_file(file)
        head = weights.get("lm_head.weight")
        if head is None:  # another shard
            continue
        g = torch.Generator().manual_seed(seed)
        noisy = head * scale + noise * head.std() * torch.randn(head.shape, generator=g, dtype=head.dtype)
        weights["lm_head.weight"] = noisy.contiguous()
        save_file(weights, file, metadata={"format": "pt"})
        return path
    # Tied embeddings: the head is the embedding, and perturbing it would change the inputs too.
    raise ValueError(f"{target} has no separate lm_head.weight to perturb (tied embeddings?)")
