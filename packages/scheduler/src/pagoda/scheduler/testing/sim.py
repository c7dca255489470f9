"""Simulation helpers: a token-level stand-in for the model runner and the reference it must match.

`TokenCacheModel` executes a `SchedulerOutput` the way a real runner does (swap out, swap in, copies, write
the chunk's tokens into their slots, read each context back through the block table) but stores token ids
instead of K/V vectors and "samples" a deterministic function of the context it read (a chunk with draft
tokens is verified greedily: the token after each position, while the drafts match). Any slot, block table,
copy or swap the scheduler and allocator get wrong shows up as a wrong token, so tests compare its output with
`reference_output` (the same function applied to the plain sequence).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.protocols import SamplingParamsLike
from pagoda.scheduler.request import Request
from pagoda.scheduler.scheduler import Scheduler

VOCAB_SIZE = 64


@dataclass(frozen=True, slots=True)
class SimSamplingParams:
    """Minimal sampling parameters satisfying `SamplingParamsLike` (for tests, tools and other embedders)."""

    max_tokens: int = 16
    min_tokens: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0


def next_token(context: Sequence[int], salt: int = 0) -> int:
    """The fake model: a rolling polynomial of the whole context (so any wrong KV entry changes it)."""
    h = salt * 7919 + len(context)
    for token in context:
        h = (h * 31 + token) % 1_000_003
    return h % VOCAB_SIZE


def reference_output(
    prompt: Sequence[int], params: SamplingParamsLike, max_model_len: int, sample_index: int = 0
) -> list[int]:
    """What `TokenCacheModel` must produce for one sample, computed without any cache or scheduler."""
    context, output = list(prompt), []
    salt = sample_index  # the samples of one prompt differ only in their first token's salt
    while True:
        token = next_token(context, salt)
        salt = 0
        context.append(token)
        output.append(token)
        if len(output) >= params.min_tokens and token in params.stop_token_ids:
            return output
        if len(output) >= params.max_tokens or len(context) >= max_model_len:
            return output


class TokenCacheModel:
    """A model runner over a paged cache of token ids (one int per slot) instead of K/V vectors."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        sliding_windows: Sequence[int | None] = (None,),
    ) -> None:
        """A cache shaped like the allocator's two tiers; every slot starts empty (None).

        `sliding_windows` has one entry per KV cache group (None: full attention, which group 0 must be): every
        group's slots are written, and each group's window of the context must read back the same tokens.
        """
        if sliding_windows[0] is not None:
            raise ValueError("group 0 must be full attention: the tokens are sampled from its whole context")
        self.sliding_windows = tuple(sliding_windows)
        self.block_size = block_size
        self.device: list[int | None] = [None] * (num_blocks * block_size)
        self.host: list[int | None] = [None] * (num_host_blocks * block_size)

    def _copy(self, src: list[int | None], src_block: int, dst: list[int | None], dst_block: int) -> None:
        """Copy one block's slots between tiers (or within one)."""
        bs = self.block_size
        dst[dst_block * bs : (dst_block + 1) * bs] = src[src_block * bs : (src_block + 1) * bs]

    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:
        """Run one step; the sampled tokens per sample id, as `Scheduler.update_from_output` takes them."""
        bs = self.block_size
        for device_block, host_block in output.blocks_to_swap_out:
            self._copy(self.device, device_block, self.host, host_block)
        for host_block, device_block in output.blocks_to_swap_in:
            self._copy(self.host, host_block, self.device, device_block)
        for src, dst in output.blocks_to_copy:
            self._copy(self.device, src, self.device, dst)
        # Every chunk's KV is written before any context is read, as reshape_and_cache precedes attention.
        for chunk in output.scheduled:
            tables = chunk.group_block_tables or (chunk.block_table,)
            group_slots = chunk.group_slots or (chunk.slots,)
            assert len(tables) == len(group_slots) == len(self.sliding_windows), chunk
            for table, slots in zip(tables, group_slots, strict=True):
                assert len(chunk.token_ids) == len(slots) == chunk.num_tokens, chunk
                for pos, (token, slot) in enumerate(zip(chunk.token_ids, slots, strict=True), chunk.start):
                    assert slot == table[pos // bs] * bs + pos % bs, (chunk, pos)
                    self.device[slot] = token
        sampled: dict[str, list[int]] = {}
        for chunk in output.scheduled:
            if not chunk.num_samples:
                continue
            table = chunk.block_table
            context = [self.device[table[p // bs] * bs + p % bs] for p in range(chunk.seq_len)]
            known = [t for t in context if t is not None]
            assert len(known) == len(context), f"{chunk.request_id!r} reads an empty slot"
            for window, group_table in zip(
                self.sliding_windows[1:], chunk.group_block_tables[1:], strict=True
            ):
                # A sliding group's last query sees the keys of its window, which must hold the same tokens.
                first = 0 if window is None else max(0, chunk.seq_len - window)
                for p in range(first, chunk.seq_len):
                    got = self.device[group_table[p // bs] * bs + p % bs]
                    assert got == known[p], f"{chunk.request_id!r}: group slot of position {p}"
            spec = chunk.spec_token_ids
            if spec:
                sampled[chunk.request_id] = self._verify(known, spec)
                continue
            for index, sample_id in enumerate(chunk.sample_ids):
                sampled[sample_id] = [next_token(known, index)]
        return sampled

    @staticmethod
    def _verify(context: list[int], spec: tuple[int, ...]) -> list[int]:
        """Greedy verification of a draft chunk: the token after each position while the drafts match it."""
        first = len(context) - len(spec)  # the context of the chunk's first (non-draft) position
        tokens: list[int] = []
        for j in range(len(spec) + 1):
            token = next_token(context[: first + j])
            tokens.append(token)
            if j == len(spec) or token != spec[j]:
                return tokens
        return tokens


@dataclass(slots=True)
class RunResult:
    """What `run_to_completion` saw."""

    finished: list[Request] = field(default_factory=list)
    outputs: list[SchedulerOutput] = field(default_factory=list)


def run_to_completion(
    scheduler: Scheduler,
    model: TokenCacheModel,
    *,
    max_steps: int = 100_000,
    before_step: Callable[[int], None] | None = None,
    after_schedule: Callable[[SchedulerOutput], None] | None = None,
    pending: Callable[[], bool] | None = None,
) -> RunResult:
    """Step `scheduler` with `model` until nothing is unfinished (and `pending()`, if given, is False).

    `before_step(i)` may add or abort requests; `after_schedule(output)` may check invariants.
    """
    result = RunResult()
    for step in range(max_steps):
        if before_step is not None:
            before_step(step)
        if not scheduler.has_unfinished_requests() and (pending is None or not pending()):
            return result
        output = scheduler.schedule()
        if after_schedule is not None:
            after_schedule(output)
        result.outputs.append(output)
        result.finished += scheduler.update_from_output(output, model.execute(output))
    raise RuntimeError(f"not done after {max_steps} steps")
