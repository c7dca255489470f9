"""`DraftModel`: the `draft_model` proposer, a smaller model of the same vocabulary with its own paged KV.

Each step, after every request closed it (`end_step` queues its running, decoding samples here), `draft` runs
the draft for all of them at once: one forward that catches each sequence's draft KV up on the tokens accepted
since its last drafts (a prefill of them, ending at the sequence's last token, whose logits give the first
draft), then k - 1 decode forwards of the batch. Greedy rows take the draft's argmax; sampled rows draw from
q (the draft's logits under the row's own sampling parameters) and keep q, which verification needs (`spec.verify.rejection_sample`).

The draft's KV lives in its own `BlockManager` (no prefix caching: its blocks are never shared) over its own
cache tensors. Its cache holds the sequence's tokens plus the drafts fed back in; before the next drafts, the
tokens that differ from the sequence's (the rejected drafts) are trimmed off, freeing their tail blocks. A
sequence that finished, was preempted or aborted frees its draft KV (`release`; `draft` also frees every
sequence the scheduler no longer runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from pagoda.blockalloc import BlockManager
from pagoda.pagedkernel.sampling import GREEDY_TEMPERATURE, rng_key
from pagoda.pagedkernel.sampling.rng import uniforms
from pagoda.scheduler import RequestStatus, ScheduledRequest, Scheduler, SchedulerOutput
from pagoda.server.request_contract import DrawSpec
from pagoda.server.sampling import SamplingRow
from torch import Tensor

# The distribution of each row's draw, as `Sampler.probabilities` gives it: float32 [rows, vocab].
Probabilities = Callable[[Tensor, Sequence[SamplingRow]], Tensor]

# Salts the draft's own draws apart from the target's (whose keys are rng_key(seed, sample, position)).
DRAFT_SEED_SALT = 0x5DEECE66D


class DraftRunner(Protocol):
    """What runs the draft: the engine's `ModelRunner` over the draft model and its KV cache."""

    def execute(
        self, output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[Tensor, Mapping[str, object]]:  # ([num_rows, vocab], unused)
        """One forward of the scheduled chunks: the logits of each chunk's last position."""
        ...


@dataclass(frozen=True, slots=True)
class Drafted:
    """A sequence's latest drafts and, for a sampled row, the draft's distribution at each of them."""

    drafts: tuple[int, ...]
    probs: Tensor | None  # float32 [len(drafts), vocab]: q of each position; None for greedy rows


@dataclass(slots=True)
class _Job:
    """One sequence to draft for this step."""

    seq_id: str
    token_ids: list[int]  # the sequence so far (prompt, then outputs), then its drafts as they come
    num_known: int  # tokens of the sequence proper (the rest of token_ids are drafts)
    k: int
    spec: DrawSpec
    on_drafts: Callable[[str, int], None]  # told how many drafts the sequence got
    probs: list[Tensor]  # float32 [vocab] rows of q (sampled rows only)
    live: bool = True  # False once its draft KV ran out of blocks (no further drafts this step)


class DraftModel:
    """Batched drafting for every speculative request of an engine (see the module docstring)."""

    def __init__(
        self, runner: DraftRunner, kv: BlockManager, max_model_len: int, probabilities: Probabilities
    ) -> None:
        """Draft with `runner` (its model and cache tensors) into the blocks `kv` hands out; `probabilities`
        turns the draft's logits into a sampled row's q (the target sampler's)."""
        self.runner = runner
        self.probabilities = probabilities
        self.kv = kv
        self.max_model_len = max_model_len
        self._cached: dict[str, list[int]] = {}  # seq id -> tokens whose KV the draft cache holds
        self._known: dict[
            str, int
        ] = {}  # seq id -> how many of those were the sequence's own at last drafting
        self._queue: list[_Job] = []
        self._drafted: dict[str, Drafted] = {}

    def request(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        k: int,
        spec: DrawSpec,
        on_drafts: Callable[[str, int], None],
    ) -> None:
        """Queue `seq_id` for up to `k` drafts after `token_ids` at this step's `draft` call."""
        k = min(k, self.max_model_len - len(token_ids))
        self._drafted.pop(seq_id, None)
        if k < 1:
            on_drafts(seq_id, 0)
            return
        self._queue.append(_Job(seq_id, list(token_ids), len(token_ids), k, spec, on_drafts, []))

    def release(self, seq_id: str) -> None:
        """Free a sequence's draft KV (finished, preempted, aborted); unknown ids are ignored."""
        if self._cached.pop(seq_id, None) is not None:
            self.kv.free(seq_id)
        self._known.pop(seq_id, None)
        self._drafted.pop(seq_id, None)

    def draft_probs(self, seq_id: str, drafts: Sequence[int]) -> Tensor | None:
        """q of the scheduled `drafts` (a prefix of the proposed ones, the scheduler may cut them): float32
        [len(drafts), vocab]; None for a greedy row or drafts this proposer did not make."""
        drafted = self._drafted.get(seq_id)
        if drafted is None or drafted.probs is None or tuple(drafts) != drafted.drafts[: len(drafts)]:
            return None
        return drafted.probs[: len(drafts)]

    def draft(self, scheduler: Scheduler) -> None:
        """Free the draft KV of sequences no longer running, then draft for every queued sequence, batched."""
        for seq_id in list(self._cached):
            request = scheduler.get_request(seq_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                self.release(seq_id)
        jobs, self._queue = self._queue, []
        active = [job for job in jobs if self._catch_up(job)]
        first = True
        while active:
            chunks = [self._chunk(job, first) for job in active]
            self._sample(active, self._forward(chunks))
            first = False
            active = [job for job in active if len(job.token_ids) - job.num_known < job.k and self._grow(job)]
        for job in jobs:
            drafts = tuple(job.token_ids[job.num_known :])
            probs = torch.stack(job.probs) if job.probs and len(job.probs) == len(drafts) else None
            self._drafted[job.seq_id] = Drafted(drafts, probs)
            scheduler.set_draft_token_ids(job.seq_id, drafts)
            job.on_drafts(job.seq_id, len(drafts))

    def check_invariants(self) -> None:
        """AssertionError unless every tracked sequence's draft KV holds exactly its cached tokens."""
        self.kv.check_invariants()
        assert set(self._cached) == set(self.kv.seqs), (sorted(self._cached), sorted(self.kv.seqs))
        for seq_id, cached in self._cached.items():
            assert self.kv.num_tokens(seq_id) == len(cached), seq_id

    # ----------------------------------------------------------------- internals

    def _catch_up(self, job: _Job) -> bool:
        """Trim the rejected drafts off the sequence's draft KV and give slots to the tokens it lacks (False: no
        blocks left, no drafts this step)."""
        seq_id, tokens = job.seq_id, job.token_ids
        cached = self._cached.get(seq_id)
        if cached is None:
            alloc = self.kv.allocate_slots(seq_id, tokens, len(tokens))
            if alloc is None:
                return False
            self._cached[seq_id] = []
        else:
            # Tokens up to the last drafting's sequence length are the sequence's: compare only after them.
            same = min(self._known.get(seq_id, 0), len(cached), len(tokens) - 1)
            while same < min(len(cached), len(tokens) - 1) and cached[same] == tokens[same]:
                same += 1
            if same < len(cached):  # rejected drafts (or their KV past the accepted ones): roll back
                self.kv.trim(seq_id, same)
                del cached[same:]
            if self.kv.allocate_slots(seq_id, tokens, len(tokens) - same) is None:
                return False
        self._known[seq_id] = len(tokens)
        return True

    def _chunk(self, job: _Job, first: bool) -> ScheduledRequest:
        """The job's chunk: every token its draft KV lacks (the first forward), else its latest draft."""
        cached = self._cached[job.seq_id]
        start = len(cached) if first else len(job.token_ids) - 1
        new = tuple(job.token_ids[start:])
        cached.extend(new)
        slots = self._slots(job.seq_id, start, len(job.token_ids))
        return ScheduledRequest(
            request_id=job.seq_id,
            token_ids=new,
            start=start,
            num_tokens=len(new),
            block_table=self.kv.block_table(job.seq_id),
            slots=slots,
            num_samples=1,
            sample_ids=(job.seq_id,),
        )

    def _slots(self, seq_id: str, start: int, end: int) -> tuple[int, ...]:
        """KV slots of positions start..end-1 of a sequence (its blocks are allocated)."""
        table, bs = self.kv.block_table(seq_id), self.kv.block_size
        return tuple(table[p // bs] * bs + p % bs for p in range(start, end))

    def _grow(self, job: _Job) -> bool:
        """A slot for the latest draft, fed back in next (False: no block left, the drafts stop here)."""
        if self.kv.allocate_slots(job.seq_id, job.token_ids, 1) is None:
            job.live = False
        return job.live

    def _forward(self, chunks: list[ScheduledRequest]) -> Tensor:  # [num_chunks, vocab]
        """One forward of the draft over the chunks."""
        total = sum(c.num_tokens for c in chunks)
        output = SchedulerOutput(tuple(chunks), (), (), (), (), (), total)
        logits, _ = self.runner.execute(output, {})
        return logits

    def _sample(self, jobs: list[_Job], logits: Tensor) -> None:  # logits [num_jobs, vocab]
        """Each job's next draft: the argmax for greedy rows; for sampled rows a draw from q, the distribution
        the target's sampling parameters make of the draft's logits (temperature, top_k, top_p, min_p, the
        history penalties over the drafts so far), so that q resembles the target's p."""
        x = logits.float()
        greedy = x.argmax(dim=-1).tolist()
        sampled = [i for i, job in enumerate(jobs) if job.spec.row.params.temperature >= GREEDY_TEMPERATURE]
        for i, job in enumerate(jobs):
            if i not in sampled:
                job.token_ids.append(int(greedy[i]))
        if not sampled:
            return
        rows = []
        for i in sampled:
            job = jobs[i]
            history = [*job.spec.row.output_token_ids, *job.token_ids[job.num_known :]]
            rows.append(dataclasses.replace(job.spec.row, output_token_ids=history))
        index = torch.tensor(sampled, dtype=torch.int64, device=x.device)
        q = self.probabilities(x.index_select(0, index), rows)  # [num_sampled, vocab]
        # The draws' keys: each draft's output position, salted apart from the target's own draws.
        keys = [
            rng_key(row.seed ^ DRAFT_SEED_SALT, row.sample_index, len(row.output_token_ids)) for row in rows
        ]
        u = uniforms(torch.tensor(keys, dtype=torch.int64, device=x.device), x.shape[1])
        scores = torch.where(q > 0, torch.log(q) - torch.log(-torch.log(u)), float("-inf"))
        for j, token in enumerate(scores.argmax(dim=-1).tolist()):
            jobs[sampled[j]].token_ids.append(int(token))
            jobs[sampled[j]].probs.append(q[j])
