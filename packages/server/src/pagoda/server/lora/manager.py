"""`LoRAManager`: the adapters an engine (or one tensor-parallel rank) serves, their CPU cache and slot pool.

Adapters are loaded from disk into CPU tensors (`load`, safe to call from any thread: it touches no shared
state) and registered (`add`); at most `max_cpu_loras` stay registered, the least recently used unpinned one
leaving first (a request for it waits at the engine's `LoRAGate` while it is read again). Each step,
`prepare` puts the step's adapters into the `max_loras` slots of every hooked layer (the scheduler never
schedules more distinct adapters in one step), reusing a slot that already holds one, and sets every token row's
slot for the hooks.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from pagoda.pagedkernel.lora import LoRABackendName
from pagoda.server.lora.layers import EmbeddingLoRAHook, HeadLoRAHook, LoRABatch, LoRAHook
from pagoda.server.lora.peft_loader import LoRAAdapter, LoRAWeights, fingerprint, load_adapter
from pagoda.server.lora.request import LoRARequest
from pagoda.server.lora.targets import EMBEDDING, LM_HEAD, find_targets
from pagoda.server.models.base import CausalLM, DecoderLM
from pagoda.server.models.layers import Embedding, Linear, MergedLinear
from torch import Tensor

# The rows of chunks at least this long (prompts) are matmuls per slot and projection (`LoRABatch.groups`);
# shorter ones (decodes) go through the row-gathering op. Only on the CPU without the C op (`LoRALayer.runs_in_c`,
# which groups and blocks the rows itself, faster than the matmuls): the GPU kernels batch both alike.
LONG_CHUNK = 16


@dataclass(frozen=True, slots=True)
class LoRARows:
    """Every token row's slot of some chunks, as the hooks read it (`LoRABatch`'s fields)."""

    slots: Tensor  # int64 [num_tokens]; negative: no adapter
    short_slots: (
        Tensor  # int64 [num_tokens]: `slots` with the grouped rows at -1 (`slots` itself without any)
    )
    groups: tuple[tuple[int, Tensor | slice], ...]  # the long chunks' rows by slot


class AdapterChunk(Protocol):
    """What `prepare` reads of a step's chunk: a `ScheduledRequest`, or an FFN rank's `AdapterRun`."""

    @property
    def lora_id(self) -> int | None:
        """The chunk's adapter (None: the base model)."""
        ...

    @property
    def num_tokens(self) -> int:
        """The chunk's token rows."""
        ...


def _rows(ids: list[int]) -> Tensor | slice:
    """A slot's grouped rows: a slice when they are one run (no gather, no scatter), else int64 indices."""
    if ids[-1] - ids[0] + 1 == len(ids):
        return slice(ids[0], ids[-1] + 1)
    return torch.tensor(ids, dtype=torch.int64)


class LoRAManager:
    """Hooks every adaptable projection of `model` and serves adapters through `max_loras` slots."""

    def __init__(
        self,
        model: CausalLM,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: LoRABackendName = "auto",
    ) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.dtype = dtype
        self.device = device
        self.targets = find_targets(model)
        self.batch = LoRABatch()
        self.hooks: dict[str, LoRAHook] = {}
        for module_name in dict.fromkeys(t.module for t in self.targets.values() if t.kind == "linear"):
            module = model.get_submodule(module_name)
            assert isinstance(module, Linear)
            rows, cols = module.weight_shape()
            shards = module.shard_sizes if isinstance(module, MergedLinear) else (rows,)
            hook = LoRAHook(
                self.batch,
                cols,
                shards,
                num_slots=max_loras,
                max_rank=max_lora_rank,
                dtype=dtype,
                device=device,
                backend=backend,
            )
            module.lora = hook
            self.hooks[module_name] = hook
        if isinstance(model, DecoderLM):
            self._hook_vocabulary(model, backend)
            model.memory_moved()  # the projections have hooks now, which the native decode layers do not run
        # Whether long chunks become matmul groups: on the CPU when the projections' op is not the C one.
        self.group_long_chunks = device.type == "cpu" and not all(
            hook.layer is None or hook.layer.runs_in_c for hook in self.hooks.values()
        )
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # registered, least recently used first
        self.slot_ids: list[int | None] = [None] * max_loras  # the adapter each slot holds
        self.pins: defaultdict[int, int] = defaultdict(int)  # unfinished requests per adapter id

    def _hook_vocabulary(self, model: DecoderLM, backend: LoRABackendName) -> None:
        """The embedding's and the LM head's hooks (pools allocated when an adapter first targets them)."""
        head = model.head()
        embed = model.model.get_submodule("embed_tokens")
        assert isinstance(embed, Embedding)
        per, hidden = head.run.per, head.weight_shape()[1]
        slots, rank, dtype, device = self.max_loras, self.max_lora_rank, self.dtype, self.device
        embed_hook = EmbeddingLoRAHook(
            self.batch,
            per,
            hidden,
            num_slots=slots,
            max_rank=rank,
            dtype=dtype,
            device=device,
            backend=backend,
        )
        head_hook = HeadLoRAHook(
            self.batch,
            hidden,
            (per,),
            num_slots=slots,
            max_rank=rank,
            dtype=dtype,
            device=device,
            backend=backend,
            lazy=True,
        )
        embed.lora, model.head_lora = embed_hook, head_hook
        self.hooks[EMBEDDING], self.hooks[LM_HEAD] = embed_hook, head_hook

    def keep_hooks(self, applies: Callable[[str], bool]) -> None:
        """Apply adapters only to the modules `applies` names (attention/FFN disaggregation: each rank to the
        projections it runs). Every target stays, so an adapter is still checked and read whole."""
        self.hooks = {name: hook for name, hook in self.hooks.items() if applies(name)}

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter from disk (LoRAError naming the field); registers nothing. A folder already
        registered under another name, unchanged since, is not read again: its weights are shared."""
        source = fingerprint(request.lora_path)
        twin = self._twin(source)
        if twin is not None:
            return replace(twin, request=request)
        return load_adapter(request, self.targets, max_rank=self.max_lora_rank, dtype=self.dtype)

    def _twin(self, source: tuple[int, ...] | None) -> LoRAAdapter | None:
        """A registered adapter read from the same files (any thread: a copy of the values is iterated)."""
        if source is None:
            return None
        return next((a for a in tuple(self.adapters.values()) if a.source == source), None)

    def add(self, adapter: LoRAAdapter) -> None:
        """Register a loaded adapter (replacing one of the same id), evicting unpinned ones beyond max_cpu_loras.

        One folder under many names holds one copy of its weights: two reads of it that raced share here."""
        twin = self._twin(adapter.source)
        if twin is not None and twin.weights is not adapter.weights:
            adapter = replace(adapter, weights=twin.weights, rank=twin.rank)
        lora_id = adapter.request.lora_int_id
        self._drop_slot(lora_id)
        self.adapters[lora_id] = adapter
        self.adapters.move_to_end(lora_id)
        self._trim(keep=lora_id)

    def _trim(self, keep: int | None = None) -> None:
        """Evict least recently used unpinned adapters beyond max_cpu_loras (pinned ones may exceed it a while)."""
        for old in list(self.adapters):
            if len(self.adapters) <= self.max_cpu_loras:
                break
            if old != keep and not self.pins.get(old):
                self.remove(old)

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter's weights (its slot too); whether it was registered."""
        self._drop_slot(lora_id)
        return self.adapters.pop(lora_id, None) is not None

    def has(self, lora_id: int) -> bool:
        """Whether the adapter's weights are registered (requests for it can be scheduled)."""
        return lora_id in self.adapters

    def pin(self, lora_id: int) -> None:
        """One more unfinished request runs under the adapter: it is not evicted meanwhile."""
        self.pins[lora_id] += 1

    def unpin(self, lora_id: int) -> None:
        """A request under the adapter finished."""
        self.pins[lora_id] -= 1
        if self.pins[lora_id] <= 0:
            del self.pins[lora_id]
            self._trim()

    def _drop_slot(self, lora_id: int) -> None:
        """Free the slot holding `lora_id`, if any (it is reloaded at its next use)."""
        for slot, held in enumerate(self.slot_ids):
            if held == lora_id:
                self.slot_ids[slot] = None

    def _slot_of(self, lora_id: int, needed: set[int]) -> int:
        """The slot holding `lora_id`, loading it into a free slot (one no adapter of this step needs)."""
        if lora_id in self.slot_ids:
            return self.slot_ids.index(lora_id)
        slot = next((i for i, held in enumerate(self.slot_ids) if held is None or held not in needed), None)
        if slot is None:
            raise RuntimeError(f"a step uses more than max_loras={self.max_loras} adapters")
        adapter = self.adapters.get(lora_id)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter id {lora_id} is scheduled but not loaded")
        by_module: dict[str, dict[int, LoRAWeights]] = defaultdict(dict)
        for name, weights in adapter.weights.items():
            target = self.targets[name]
            by_module[target.module][target.shard] = weights
        for module_name, hook in self.hooks.items():
            hook.load(slot, by_module.get(module_name, {}))
        self.slot_ids[slot] = lora_id
        self.adapters.move_to_end(lora_id)
        return slot

    def prepare(self, scheduled: Sequence[AdapterChunk]) -> None:
        """Slot the step's adapters and set every token row's slot (None when no chunk has an adapter)."""
        needed = {c.lora_id for c in scheduled if c.lora_id is not None}
        for lora_id in sorted(needed):
            self._slot_of(lora_id, needed)
        self.use(self.rows_of(scheduled))

    def rows_of(self, chunks: Sequence[AdapterChunk]) -> LoRARows | None:
        """The slot of every token row of `chunks`, whose adapters `prepare` has slotted (a part of its step:
        attention/FFN disaggregation's micro-batches); None when no chunk has an adapter."""
        if all(chunk.lora_id is None for chunk in chunks):
            return None
        rows: list[int] = []
        short: list[int] = []  # the rows of short chunks (decodes); long chunks' rows go to `groups`
        grouped: defaultdict[int, list[int]] = defaultdict(list)
        for chunk in chunks:
            slot = -1 if chunk.lora_id is None else self.slot_ids.index(chunk.lora_id)
            if slot >= 0 and chunk.num_tokens >= LONG_CHUNK and self.group_long_chunks:
                grouped[slot].extend(range(len(rows), len(rows) + chunk.num_tokens))
                short.extend([-1] * chunk.num_tokens)
            else:
                short.extend([slot] * chunk.num_tokens)
            rows.extend([slot] * chunk.num_tokens)
        slots = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return LoRARows(
            slots,
            torch.tensor(short, dtype=torch.int64) if grouped else slots,
            tuple((slot, _rows(ids)) for slot, ids in grouped.items()),
        )

    def current(self) -> LoRARows | None:
        """The rows the hooks read now (None: no adapter), to `use` again later."""
        batch = self.batch
        if batch.slots is None:
            return None
        short = batch.short_slots if batch.short_slots is not None else batch.slots
        return LoRARows(batch.slots, short, batch.groups)

    def use(self, rows: LoRARows | None) -> None:
        """Point the hooks at these rows' slots (None: no adapter)."""
        self.batch.head_slots = None
        if rows is None:
            self.batch.slots = None
            return
        self.batch.slots, self.batch.short_slots, self.batch.groups = (
            rows.slots,
            rows.short_slots,
            rows.groups,
        )

    def select_head_rows(
        self,
        logits_indices: Tensor
        | None,  # int64 [num_logits_rows]: the token rows the LM head scores; None: none
    ) -> None:
        """The slots of the rows the LM head scores next (None after it: prompt-logprob slices run the base head)."""
        slots = self.batch.slots
        self.batch.head_slots = None if slots is None or logits_indices is None else slots[logits_indices]

    def requests_for(self, scheduled: Sequence[AdapterChunk]) -> tuple[LoRARequest, ...]:
        """The adapters a step uses, for the tensor-parallel workers (which read one they do not hold)."""
        ids = sorted({c.lora_id for c in scheduled if c.lora_id is not None})
        return tuple(self.adapters[i].request for i in ids if i in self.adapters)

    def ensure(self, requests: Sequence[LoRARequest]) -> None:
        """Read (this rank's shard of) every adapter not held yet: a worker's side of `requests_for`."""
        for request in requests:  # pinned meanwhile, so that reading one never evicts another of the step
            self.pin(request.lora_int_id)
        try:
            for request in requests:
                if not self.has(request.lora_int_id):
                    self.add(self.load(request))
        finally:
            for request in requests:
                self.unpin(request.lora_int_id)

    def clear(self) -> None:
        """No adapter rows (after a step, so that other forwards, e.g. cost probes, run the base model)."""
        self.batch.slots = None
        self.batch.head_slots = None
