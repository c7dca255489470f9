"""KV cache groups (the hybrid KV cache manager): which layers share a block table, and where each layer's cache is.

Layers are grouped by attention type (full attention, or a sliding window W). As in vLLM, every group gets the
same number of layers, `layers_per_group` (the gcd of the types' layer counts), so that all groups draw from one
block pool with one page size: the cache holds `layers_per_group` (K, V) tensor pairs, and block b of pair s is
the memory of the s-th layer of whichever group owns block b. Gemma 3 270M (15 sliding : 3 full layers) gets one
full group and five sliding groups of 3 layers; a model whose layers all share one type keeps one group of all
its layers. A sliding group's sequences only keep the blocks inside the window, which is what makes long
sequences cheap. Without hybrid grouping (`--disable-hybrid-kv-cache-manager`) every layer is in one
full-attention group: today's layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.blockalloc import FULL_ATTENTION, KVCacheGroupSpec


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The groups, and for every model layer its group and its (K, V) tensor pair."""

    groups: tuple[KVCacheGroupSpec, ...]
    layer_groups: tuple[int, ...]  # per model layer: its group's index
    layer_slots: tuple[int, ...]  # per model layer: the index of its (K, V) tensor pair
    layers_per_group: int  # (K, V) tensor pairs in the cache

    @property
    def num_layers(self) -> int:
        """Model layers."""
        return len(self.layer_groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether any group keeps only a window (so its blocks are released as sequences advance)."""
        return any(g.sliding_window is not None for g in self.groups)

    def blocks_for_tokens(self, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
        """Most blocks one sequence of `num_tokens` tokens holds over all groups (steps of `chunk_tokens`)."""
        return sum(g.max_blocks(num_tokens, block_size, chunk_tokens) for g in self.groups)

    def describe(self) -> str:
        """For the start-up log: e.g. "1 x full + 5 x window 512, 3 layers each"."""
        counts: dict[int | None, int] = {}
        for g in self.groups:
            counts[g.sliding_window] = counts.get(g.sliding_window, 0) + 1
        kinds = [f"{n} x {'full' if w is None else f'window {w}'}" for w, n in counts.items()]
        return f"{' + '.join(kinds)}, {self.layers_per_group} layers each"


def plan_kv_cache_layout(layer_windows: Sequence[int | None], *, hybrid: bool) -> KVCacheLayout:
    """Group layers by sliding window (None: full attention); one full group of every layer without `hybrid`."""
    num_layers = len(layer_windows)
    if num_layers == 0:
        raise ValueError("a model without attention layers has no KV cache")
    if not hybrid or all(w is None for w in layer_windows):
        return KVCacheLayout((FULL_ATTENTION,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    # Full attention first, so that group 0 (the scheduler's `block_table`) holds a whole table when there is one.
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    counts = {w: sum(1 for x in layer_windows if x == w) for w in kinds}
    per_group = math.gcd(*counts.values())
    first_group: dict[int | None, int] = {}
    groups: list[KVCacheGroupSpec] = []
    for w in kinds:
        first_group[w] = len(groups)
        groups += [KVCacheGroupSpec(sliding_window=w)] * (counts[w] // per_group)
    seen = dict.fromkeys(kinds, 0)
    layer_groups: list[int] = []
    layer_slots: list[int] = []
    for w in layer_windows:
        k = seen[w]
        seen[w] += 1
        layer_groups.append(first_group[w] + k // per_group)
        layer_slots.append(k % per_group)
    return KVCacheLayout(tuple(groups), tuple(layer_groups), tuple(layer_slots), per_group)
