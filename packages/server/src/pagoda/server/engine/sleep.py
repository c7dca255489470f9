"""Sleep mode (vLLM's `--enable-sleep-mode`): an idle engine frees its KV pool and its weights' memory, and wakes
with both back.

Level 1 offloads the weights where a cheaper tier holds them (a CUDA model's go to host memory) and otherwise
releases them; level 2 always releases them. Released weights are read again at wake from the checkpoint they were
loaded from (the converted GGUF in Pagoda's cache, or the model folder), quantized and packed as at start-up. On
the CPU the weights live in host memory already, so there both levels release them. The KV pool (device tensors
and the host swap tier) is freed at either level and allocated again, untouched, at wake: its pages become
resident only as traffic writes blocks. Memory freed inside the process goes back to the system (glibc's
`malloc_trim`, the CUDA caching allocator's `empty_cache`).

Every tensor of the model keeps its identity (`Tensor.set_` swaps its storage out and back in), so what refers to
them (the runner, LoRA hooks, a compiled forward) needs no rebuilding; a oneDNN-packed weight, whose bytes are
opaque, is unpacked to offload it and packed again at wake (bitwise the same packing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch
from pagoda.server.engine.kv_cache import KVCache
from pagoda.server.models.base import DecoderLM
from pagoda.server.models.quantized import QuantizedWeight
from torch import Tensor, nn

logger = logging.getLogger("pagoda.engine")

SleepLevel = Literal[1, 2]
SLEEP_LEVELS: tuple[int, ...] = get_args(SleepLevel)
# What `wake_up(tags)` may wake one at a time (vLLM's tags); no tags wakes both.
WakeTag = Literal["weights", "kv_cache"]
WAKE_TAGS: tuple[WakeTag, ...] = get_args(WakeTag)


class SleepModeError(ValueError):
    """A sleep or wake that cannot be done: sleep mode is off, requests are in flight, or a level or tag is bad;
    `param` names the field at fault (a 400 in the API)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_level(level: object) -> SleepLevel:
    """`level` as a sleep level; SleepModeError naming `level` for anything but 1 or 2."""
    if level == 1 and not isinstance(level, bool):
        return 1
    if level == 2 and not isinstance(level, bool):
        return 2
    raise SleepModeError(f"level must be one of {SLEEP_LEVELS}, not {level!r}", "level")


def check_tags(tags: Iterable[str] | None) -> tuple[WakeTag, ...]:
    """The tags to wake (all of them for None or none given); SleepModeError naming `tags` for an unknown one."""
    if tags is None:
        return WAKE_TAGS
    chosen = tuple(dict.fromkeys(tags))
    unknown = [tag for tag in chosen if tag not in WAKE_TAGS]
    if unknown:
        raise SleepModeError(f"tags must be among {WAKE_TAGS}, not {unknown[0]!r}", "tags")
    return tuple(tag for tag in WAKE_TAGS if tag in chosen) or WAKE_TAGS


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one tensor of a model lives: a module attribute (parameter, buffer or plain tensor) or the blocks of
    a quantized weight (`owner` then holds them; they are swapped in place only)."""

    owner: object
    name: str
    tensor: Tensor

    def replace(self, value: Tensor) -> None:
        """Put `value` in the slot (a oneDNN-packed tensor, which cannot be swapped in place)."""
        if isinstance(self.owner, nn.Module) and self.name in self.owner._parameters:
            setattr(self.owner, self.name, nn.Parameter(value, requires_grad=False))
        else:
            setattr(self.owner, self.name, value)


def weight_slots(model: nn.Module) -> dict[str, _Slot]:
    """Every tensor `model` holds, by path: parameters, buffers, plain tensor attributes (a packed LM head) and
    the blocks of quantized weights (what `resident_weight_bytes` counts). A tensor two modules share (tied
    embeddings) shows under each of its paths."""
    slots: dict[str, _Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                slots[head + name] = _Slot(module, name, tensor)
        for name, value in vars(module).items():
            if isinstance(value, Tensor):
                slots[head + name] = _Slot(module, name, value)
        quantized = getattr(module, "quantized", None)
        if isinstance(quantized, QuantizedWeight):
            for index, part in enumerate(quantized.parts):
                slots[f"{head}quantized.{index}"] = _Slot(part, "data", part.data)
    return slots


@dataclass(frozen=True, slots=True)
class _Released:
    """One released tensor: where it lived and what it was (to check what comes back)."""

    slot: _Slot
    dtype: torch.dtype
    shape: tuple[int, ...]
    packed: bool  # oneDNN's opaque layout: unpacked to offload, packed again (or replaced) at wake


class ModelWeights:
    """One model's tensors released and restored in place; `reload` builds a fresh copy of the same model from
    its checkpoint (loaded, quantized and packed as at start-up), whose tensors move into the released ones."""

    def __init__(self, model: nn.Module, reload: Callable[[], nn.Module], pack_rows: int | None) -> None:
        self.model = model
        self._reload = reload
        self._pack_rows = pack_rows  # the batch hint packed weights were packed for (None: nothing packed)
        self._released: dict[str, _Released] | None = None
        self._offloaded: dict[str, Tensor] | None = None  # level 1 on CUDA: host copies by path

    @property
    def released(self) -> bool:
        """Whether the weights are released (asleep)."""
        return self._released is not None

    @torch.inference_mode()
    def release(self, *, offload: bool) -> int:
        """Free every tensor's memory, first copying it to host memory with `offload`; the bytes released."""
        released: dict[str, _Released] = {}
        offloaded: dict[str, Tensor] | None = {} if offload else None
        seen: set[int] = set()
        freed = 0
        for path, slot in weight_slots(self.model).items():
            tensor = slot.tensor
            if id(tensor) in seen:
                continue  # one tensor under two paths (tied embeddings) is released once
            seen.add(id(tensor))
            packed = tensor.is_mkldnn
            released[path] = _Released(slot, tensor.dtype, tuple(tensor.shape), packed)
            freed += tensor.numel() * tensor.element_size()
            if offloaded is not None:
                dense = tensor.to_dense() if packed else tensor
                offloaded[path] = dense.to("cpu", copy=True)
            if packed:
                slot.replace(torch.empty(0, dtype=tensor.dtype))
            else:
                _adopt(tensor, torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        self._released, self._offloaded = released, offloaded
        return freed

    @torch.inference_mode()
    def restore(self) -> None:
        """Put the weights back: the host copies of an offload, else those of a fresh load of the checkpoint."""
        released = self._released
        if released is None:
            return
        if self._offloaded is not None:
            sources = self._offloaded
        else:
            fresh = self._reload()
            sources = {path: slot.tensor for path, slot in weight_slots(fresh).items()}
        for path, item in released.items():
            source = sources.get(path)
            if source is None or source.dtype != item.dtype or tuple(source.shape) != item.shape:
                raise RuntimeError(
                    f"the reloaded weights do not match the model's: {path} was {item.dtype} {list(item.shape)}, "
                    f"now {None if source is None else (source.dtype, list(source.shape))}"
                )
            if item.packed:
                item.slot.replace(source if source.is_mkldnn else self._pack(source))
            else:
                device = item.slot.tensor.device
                _adopt(item.slot.tensor, source if source.device == device else source.to(device))
        self._released, self._offloaded = None, None
        if isinstance(self.model, DecoderLM):
            self.model.memory_moved()  # new storages under the same tensors

    def _pack(self, dense: Tensor) -> Tensor:
        """A host copy of a packed weight, packed again for the same batch hint (the same reorder as at load)."""
        packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(dense, self._pack_rows or 1)
        return packed


def _adopt(tensor: Tensor, source: Tensor) -> None:
    """Make `tensor` a view of `source`'s memory (its own memory is released once nothing else holds it)."""
    tensor.set_(source.untyped_storage(), source.storage_offset(), source.size(), source.stride())


@dataclass(frozen=True, slots=True)
class SleepingRunner:
    """One model runner's parts that sleep: its KV pool and its weights (the target model's, a draft model's)."""

    kv_cache: (
        KVCache | None
    )  # None: a process that holds no KV pool (an FFN rank of attention/FFN disaggregation)
    weights: ModelWeights


def return_freed_memory(device: torch.device) -> None:
    """Hand memory freed inside the process back to the system: glibc keeps freed heap pages (and the engine
    asks it to keep large blocks, engine/host.py) until `malloc_trim`; CUDA's caching allocator keeps its blocks
    until `empty_cache`."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim") and hasattr(libc, "gnu_get_libc_version"):
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim(0)


class SleepFollowers(Protocol):
    """Other processes whose parts sleep and wake with the engine's (tensor-parallel workers: the executor):
    told first, so that they work beside the engine's own process, then waited for."""

    def send_sleep(self, level: SleepLevel) -> None:
        """Tell every follower to sleep at `level`."""

    def send_wake(self, tags: Sequence[WakeTag]) -> None:
        """Tell every follower to wake what `tags` name."""

    def wait_sleep_states(self) -> Sequence[object]:
        """Wait until every follower has done what it was told; what each holds now (for logs and tests)."""


class EngineSleep:
    """The sleep state of one engine's runners: what is asleep, and how to put it to sleep and wake it."""

    def __init__(
        self, runners: Sequence[SleepingRunner], device: torch.device, followers: SleepFollowers | None = None
    ) -> None:
        """`followers`: the tensor-parallel workers, whose shards sleep and wake with the driver's."""
        self.runners = tuple(runners)
        self.device = device
        self.followers = followers
        self.follower_states: tuple[object, ...] = ()  # what each follower said it holds after the last call
        self.level: SleepLevel | None = None  # the level slept at; None while awake
        self.asleep: set[WakeTag] = set()  # what is still asleep ("weights", "kv_cache")

    @property
    def is_sleeping(self) -> bool:
        """Whether anything is asleep (after a partial wake, the rest still is)."""
        return bool(self.asleep)

    def sleep(self, level: SleepLevel) -> None:
        """Free the KV pools and release (or, at level 1 on CUDA, offload) the weights; a second sleep is a
        no-op, as in vLLM."""
        if self.asleep:
            logger.info("sleep (level %d): the engine is asleep already", level)
            return
        start = time.perf_counter()
        offload = level == 1 and self.device.type == "cuda"
        if self.followers is not None:
            self.followers.send_sleep(level)
        freed = 0
        for runner in self.runners:
            if runner.kv_cache is not None:
                freed += runner.kv_cache.release()
            freed += runner.weights.release(offload=offload)
        return_freed_memory(self.device)
        if self.followers is not None:
            self.follower_states = tuple(self.followers.wait_sleep_states())
        self.level, self.asleep = level, set(WAKE_TAGS)
        logger.info(
            "asleep (level %d): %.1f MiB of KV pool and weights released (%s) in %.2f s",
            level,
            freed / 2**20,
            "weights offloaded to host memory" if offload else "weights reloaded from the checkpoint at wake",
            time.perf_counter() - start,
        )

    def wake_up(self, tags: Sequence[WakeTag]) -> None:
        """Wake what `tags` name (weights first, as vLLM does to keep the device memory unfragmented)."""
        start = time.perf_counter()
        woken = [tag for tag in WAKE_TAGS if tag in tags and tag in self.asleep]
        if self.followers is not None and woken:
            self.followers.send_wake(woken)
        for tag in woken:
            for runner in self.runners:
                if tag == "weights":
                    runner.weights.restore()
                elif runner.kv_cache is not None:
                    runner.kv_cache.reallocate()
                    if isinstance(runner.weights.model, DecoderLM):
                        runner.weights.model.memory_moved()  # a new KV pool
            self.asleep.discard(tag)
        if self.followers is not None and woken:
            self.follower_states = tuple(self.followers.wait_sleep_states())
        if not self.asleep:
            self.level = None
        if woken:
            logger.info(
                "woke %s in %.2f s%s",
                " and ".join(woken),
                time.perf_counter() - start,
                "" if not self.asleep else f"; still asleep: {', '.join(sorted(self.asleep))}",
            )
