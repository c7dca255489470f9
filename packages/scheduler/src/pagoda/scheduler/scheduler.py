"""The continuous-batching scheduler: one token budget per step, shared by decodes, prefill chunks and admissions.

Every request has `num_computed_tokens` (KV in the cache) and `num_tokens` (prompt + outputs); a step gives
each scheduled request a chunk that moves the first towards the second. A decode is a chunk of one token, a
prefill a chunk of many, a prefix-cache hit starts `num_computed_tokens` at the cached length, and a
recompute preemption resets it to 0 — one mechanism (vLLM v1's model).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from pagoda.scheduler.adaptive import StepPlanner, StepShape
from pagoda.scheduler.admission import AdmissionRule, build_rules
from pagoda.scheduler.config import SchedulerConfig
from pagoda.scheduler.cost_model import StepSample
from pagoda.scheduler.output import ScheduledRequest, SchedulerOutput, SchedulerStats
from pagoda.scheduler.policy import SchedulingPolicy, build_policy
from pagoda.scheduler.preemption import PreemptionChoice, PreemptionCostModel, choose_preemption
from pagoda.scheduler.protocols import KVBlockManager, SlotAllocationLike
from pagoda.scheduler.request import Request, RequestRejectedError, RequestStatus
from pagoda.scheduler.slo import SLOTracker
from pagoda.scheduler.views import QueueView, queue_view

RUNNING = RequestStatus.RUNNING


@dataclass(slots=True)
class _Step:
    """What one `schedule()` call accumulates."""

    budget: int
    prefill_budget: (
        int | None
    )  # prefill tokens left (max_batch_prefill_tokens); None: only `budget` caps them
    num_prefills: int  # requests mid-prefill, those scheduled this step included (max_num_partial_prefills)
    max_num_seqs: int  # seats of the running batch in this step (the config's, or fewer by the planner)
    chunk_cap: int | None  # one request's prefill chunk (long_prefill_token_threshold, or the planner's)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    spec: dict[str, tuple[int, ...]] = field(default_factory=dict)  # scheduled draft tokens by request id
    # A running request needed a block and preempted: nobody is swapped in or admitted this step.
    under_pressure: bool = False


class Scheduler:
    """Decides, every step, which requests compute how many tokens, and keeps their KV blocks in step.

    Order inside a step: preemptions the policy makes for the most urgent waiting request (priority), running
    decodes, then running prefill chunks (preempting when a running request needs a block and none is free),
    then swapped-out requests swapped back in, then admission of waiting requests — the last two only in a
    step where no running request ran out of blocks.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVBlockManager,
        policy: SchedulingPolicy | None = None,
        preemption_costs: PreemptionCostModel | None = None,
        rules: Sequence[AdmissionRule] | None = None,
    ) -> None:
        """Schedule over the blocks of `kv`; `policy` defaults to `config.scheduling_policy`; `preemption_costs` prices swap against
        recompute for `preemption_mode="auto"` (required there, unused otherwise); `rules` (admission rules)
        default to those `config` asks for (`admission.build_rules`)."""
        if config.preemption_mode == "auto" and preemption_costs is None:
            raise ValueError('preemption_mode "auto" needs a preemption cost model')
        if config.max_model_len is None or config.max_num_batched_tokens is None:
            raise ValueError(
                "max_model_len and max_num_batched_tokens must be set (replace None by the model's)"
            )
        self.config = config
        self.max_model_len: int = config.max_model_len
        self.max_num_batched_tokens: int = config.max_num_batched_tokens  # the token budget of one step
        self.kv = kv
        self.policy: SchedulingPolicy = (
            build_policy(config, pool=(kv.num_blocks, kv.block_size)) if policy is None else policy
        )
        # A policy that shapes each step (`adaptive`) also tracks the SLOs; else a tracker of their own when the
        # config sets objectives (attainment is reported under every policy), on the engines' clock.
        self._planner: StepPlanner | None = self.policy if isinstance(self.policy, StepPlanner) else None
        self._clock: Callable[[], float] = getattr(self.policy, "clock", time.monotonic)
        self.slo: SLOTracker | None = (
            self._planner.slo
            if self._planner is not None
            else SLOTracker(config.slo_ttft_ms, config.slo_tpot_ms)
            if config.slo_ttft_ms or config.slo_tpot_ms
            else None
        )
        self.last_shape: StepShape | None = None  # the planner's shape of the latest step
        self.rules: tuple[AdmissionRule, ...] = build_rules(config) if rules is None else tuple(rules)
        self.preemption_costs = preemption_costs
        self.waiting: list[Request] = []  # new and recompute-preempted requests, in policy order
        self.running: list[Request] = []  # in admission order
        self.swapped: list[Request] = []  # preempted into the host tier, in policy order
        self._requests: dict[str, Request] = {}  # every unfinished request, children included
        # Group id -> the ids of its unfinished children (forked samples, beams), in fork order: an abort finds
        # a request's sequences without scanning every request.
        self._children: dict[str, dict[str, None]] = {}
        self._reserved_ids: set[str] = set()  # ids of children still to fork
        self._num_pending_forks = 0  # children still to fork by running requests (they hold batch seats)
        self._finished_ids: list[str] = []  # finished since the last schedule()
        self._num_preemptions = 0
        self._watermark_blocks = int(config.watermark * kv.num_blocks)
        self._block_size = kv.block_size
        # Block tables as last sent: a known sequence's table only grows at the end or has its last block
        # replaced by copy-on-write (reported in `copies`), so most steps reuse the tuple instead of asking kv.
        self._block_tables: dict[str, tuple[int, ...]] = {}
        # Several KV cache groups or a sliding window: every chunk takes its tables fresh from the allocator.
        self._grouped = kv.num_kv_cache_groups > 1 or kv.has_sliding_window
        # Speculative decoding needs the allocator to give back rejected draft slots (`trim`, an optional
        # extension of `KVBlockManager`); without it drafts are never scheduled.
        trim = getattr(kv, "trim", None)
        self._trim: Callable[[str, int], None] | None = trim if callable(trim) else None
        # A windowed allocator frees what a prefill chunk's window left behind as soon as the chunk ran.
        release = getattr(kv, "release_behind", None) if kv.has_sliding_window else None
        self._release_behind: Callable[[str, int], int] | None = release if callable(release) else None

    # ------------------------------------------------------------------ queries

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped out."""
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        """Unfinished requests (each forked child counts as one)."""
        return len(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        return self._requests.get(request_id)

    @property
    def num_running_seqs(self) -> int:
        """Batch seats taken: running requests plus the children they will fork."""
        return len(self.running) + self._num_pending_forks

    def queue_view(self, chunks: Mapping[str, int] | None = None) -> QueueView:
        """The running, waiting and swapped queues with progress; `chunks`: each sequence's last chunk length."""
        return queue_view(self.running, self.waiting, self.swapped, chunks or {})

    @property
    def supports_drafts(self) -> bool:
        """Whether draft tokens are scheduled (the allocator can `trim` rejected draft slots)."""
        return self._trim is not None

    def set_draft_token_ids(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """Propose draft tokens for the positions after running `seq_id`'s last token (unknown ids: ignored).

        The next step that decodes it computes as many of them as its budget, `max_tokens` and `max_model_len`
        leave room for, in the same chunk; `update_from_output` takes back the slots of the rejected ones.
        """
        request = self._requests.get(seq_id)
        if request is not None:
            request.spec_token_ids = tuple(token_ids)

    def tokens_before_stop(self, seq_id: str, token_ids: Sequence[int]) -> int | None:
        """How many of `token_ids`, appended in order to `seq_id`, it takes up to the one a stop rule ends it
        at (a stop token, `max_tokens`, `max_model_len`); None when none ends it (or the id is unknown)."""
        request = self._requests.get(seq_id)
        if request is None:
            return None
        sp = request.sampling_params
        for i, token in enumerate(token_ids, start=1):
            num_output = request.num_output_tokens + i
            if token in sp.stop_token_ids and num_output >= sp.min_tokens:
                return i
            if num_output >= sp.max_tokens or request.num_tokens + i >= self.max_model_len:
                return i
        return None

    def stats(self) -> SchedulerStats:
        """Queue lengths, preemptions, and the allocator's usage and prefix-cache counters."""
        kv = self.kv.stats()
        per_group = tuple(n / kv.num_blocks if kv.num_blocks else 0.0 for n in kv.num_used_blocks_per_group)
        shape = self.last_shape
        sacrificed = getattr(self._planner, "sacrificed", {})
        return SchedulerStats(
            token_budget=self.max_num_batched_tokens if shape is None else shape.token_budget,
            chunk_size=self.config.long_prefill_token_threshold or self.max_num_batched_tokens
            if shape is None
            else shape.chunk_size,
            seats=self.config.max_num_seqs if shape is None else shape.max_num_seqs,
            slo_attainment=() if self.slo is None else self.slo.attainment(),
            slo_sacrificed=(sacrificed.get("ttft", 0), sacrificed.get("tpot", 0)),
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            num_preemptions=self._num_preemptions,
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            kv_usage_per_group=per_group,
        )

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a new request; RequestRejectedError if it is malformed, can never fit, or its id is taken.

        Only what this scheduler needs is checked here. Request rules (prompt + max_tokens within
        max_model_len, token ids in the vocabulary) are the embedding engine's: see the README.
        """
        rid, sp = request.request_id, request.sampling_params
        ids = (rid, *request.child_ids())
        if any(i in self._requests or i in self._reserved_ids for i in ids):
            raise RequestRejectedError(
                f"request id {rid!r} (or one of its sample ids) is already in use", "request_id"
            )
        # Outputs are welcome on a request of one sample (one resumed from another engine's outputs: prefill/decode
        # disaggregation); it is admitted like a request preempted by recompute. A group still to fork is fresh.
        resumed_ok = not request.num_children_to_fork and request.num_output_tokens < sp.max_tokens
        if (
            request.status is not RequestStatus.WAITING
            or (request.num_output_tokens and not resumed_ok)
            or request.num_computed_tokens
        ):
            raise RequestRejectedError(f"request {rid!r} is not fresh")
        # Without a prompt token there is nothing to compute (admission would stall on it), and n < 1 or
        # max_tokens < 1 would break the seat and stop accounting.
        if request.num_prompt_tokens == 0 or sp.max_tokens < 1 or sp.n < 1:
            raise RequestRejectedError(f"request {rid!r} needs a prompt, max_tokens >= 1 and n >= 1")
        # The last sampled token is never fed back, so a sequence holds at most prompt + max_tokens - 1 slots.
        chunk = self.max_num_batched_tokens
        # With chunked prefill a chunk shrinks to what is free, down to a block's worth: the peak that must fit.
        peak_chunk = min(chunk, self._block_size) if self.config.enable_chunked_prefill else chunk
        blocks = self.kv.blocks_for_tokens(
            request.num_prompt_tokens + sp.max_tokens - 1, chunk_tokens=peak_chunk
        )
        if blocks > self.kv.num_blocks:
            # The prompt is at fault when it alone overflows the pool, else the max_tokens added to it.
            prompt_fits = (
                self.kv.blocks_for_tokens(request.num_prompt_tokens, chunk_tokens=peak_chunk)
                <= self.kv.num_blocks
            )
            raise RequestRejectedError(
                f"request {rid!r} needs {blocks} KV blocks, more than the whole pool ({self.kv.num_blocks})",
                "max_tokens" if prompt_fits else "prompt",
            )
        for span in request.encoder_spans:
            if span.atomic and span.length > chunk:
                raise RequestRejectedError(
                    f"request {rid!r} has an image of {span.length} tokens, more than one step computes "
                    f"(max_num_batched_tokens {chunk}): it can never be prefilled",
                    "messages",
                )
        if sp.n > self.config.max_num_seqs:
            raise RequestRejectedError(
                f"request {rid!r}: n={sp.n} exceeds max_num_seqs ({self.config.max_num_seqs})", "n"
            )
        self._requests[rid] = request
        self._reserved_ids.update(ids[1:])
        self.policy.enqueue(self.waiting, request, preempted=False)

    def abort_request(self, request_id: str) -> list[Request]:
        """Finish a request as aborted in whatever state it is, with its forked samples; frees blocks at once.

        Returns the aborted requests; an unknown (e.g. already finished) id aborts nothing. The group's sequences
        come from the children index, so the cost does not grow with the other requests in the scheduler.
        """
        own = self._requests.get(request_id)
        children = self._children.get(request_id, {})
        targets = ([] if own is None else [own]) + [self._requests[c] for c in children]
        for request in targets:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        return targets

    # -------------------------------------------------------------------- step

    def schedule(self) -> SchedulerOutput:
        """Plan one step (allocating its slots and advancing `num_computed_tokens` of scheduled requests)."""
        cfg = self.config
        if self._planner is not None:
            shape = self.last_shape = self._planner.plan_step(self.running, self.waiting, cfg)
            # The planner chooses below the configured ceilings, never above them.
            budget = max(1, min(shape.token_budget, self.max_num_batched_tokens))
            seats = max(1, min(shape.max_num_seqs, cfg.max_num_seqs))
            chunk: int | None = max(1, shape.chunk_size)
        else:
            budget, seats, chunk = (
                self.max_num_batched_tokens,
                cfg.max_num_seqs,
                cfg.long_prefill_token_threshold,
            )
        step = _Step(budget, cfg.max_batch_prefill_tokens, 0, seats, chunk)
        self._preempt_for_waiting(step)
        # Decodes first so a long prefill never stalls token generation, then continuing prefill chunks.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            (decodes if request.num_tokens - request.num_computed_tokens == 1 else prefills).append(request)
        step.num_prefills = len(prefills)
        for request in decodes:
            if step.budget == 0:
                break
            if request.status is RUNNING:  # else preempted earlier in this step
                self._schedule_running(request, 1, step, self._drafts(request, step.budget))
        for request in prefills:
            if step.budget == 0:
                break
            if request.status is RUNNING:
                num_new = self._chunk_len(request, request.num_computed_tokens, step)
                if num_new:
                    self._schedule_running(request, num_new, step)
        if not step.under_pressure:
            self._swap_in(step)
            if not self.swapped:  # swapped requests come back before anyone new is admitted
                self._admit(step)
        output = SchedulerOutput(
            scheduled=tuple(step.scheduled),
            blocks_to_swap_out=tuple(step.swap_out),
            blocks_to_swap_in=tuple(step.swap_in),
            blocks_to_copy=tuple(step.copies),
            preempted_request_ids=tuple(step.preempted),
            finished_request_ids=tuple(self._finished_ids),
            num_batched_tokens=budget - step.budget,
            scheduled_spec_decode_tokens=step.spec,
        )
        self._finished_ids = []
        return output

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Mapping[str, Sequence[int]],
        stop_request_ids: Collection[str] = (),
        held_ids: Collection[str] = (),
    ) -> list[Request]:
        """Append each sample id's sampled tokens, fork n > 1 requests, apply stop rules, free the finished.

        `stop_request_ids` are requests the engine stops (e.g. on a stop string); they finish as stopped.
        `held_ids` are sample ids whose token the engine decides later (beam search): nothing is appended, and
        the sequence stays RUNNING with every token computed, never scheduled, until `append_token`.
        A chunk with draft tokens (`spec_token_ids`, k of them) takes 1 to 1 + k tokens: the accepted drafts,
        then the token sampled after them. The `num_rejected` = 1 + k - len(tokens) draft positions are rolled
        back: `num_computed_tokens` goes back by that many and the allocator frees their slots (`trim`).
        Returns the requests that finished in this update (their status tells why).
        """
        finished: list[Request] = []
        for chunk in output.scheduled:
            if not chunk.num_samples:
                continue
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not RUNNING:  # aborted since schedule()
                continue
            if request.num_children_to_fork:
                self._fork(request)
            for sample_id in chunk.sample_ids:
                if sample_id in held_ids:
                    continue
                target = request if sample_id == chunk.request_id else self._requests[sample_id]
                tokens = sampled_token_ids.get(sample_id)
                if not tokens:
                    raise ValueError(f"no sampled token for scheduled sample {sample_id!r}")
                if len(tokens) > 1 or chunk.spec_token_ids:
                    self._check_accepted(sample_id, chunk.spec_token_ids, tokens)
                for token in tokens:
                    target.append_output_token(token)
                    status = self._stop_status(target, token)
                    if status is not None:
                        self._finish(target, status)
                        finished.append(target)
                        break
                else:
                    if chunk.spec_token_ids:
                        self._roll_back(target, len(chunk.spec_token_ids) + 1 - len(tokens))
            if chunk.spec_token_ids and request.status is RUNNING and chunk.request_id in held_ids:
                self._roll_back(request, len(chunk.spec_token_ids))
        for request_id in stop_request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
        if self._release_behind is not None:
            self._release_windows(output)
        return finished

    def _release_windows(self, output: SchedulerOutput) -> None:
        """Give back the window blocks each prefill chunk of `output` has passed (decodes release theirs as
        they grow, a block at a time)."""
        assert self._release_behind is not None
        for chunk in output.scheduled:
            if chunk.num_tokens <= 1 + len(chunk.spec_token_ids):
                continue
            request = self._requests.get(chunk.request_id)
            if request is not None and request.status is RUNNING:
                self._release_behind(chunk.request_id, chunk.start + chunk.num_tokens)

    def record_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The engine's report of a step it ran (after `update_from_output`): its measured wall time. A planning
        policy fits its cost model on it (with the step's shape: decode rows, prefill tokens, context read);
        the SLO tracker notes the first tokens it produced."""
        if self._planner is None and self.slo is None:
            return
        if self._planner is not None:
            self._planner.observe_step(StepSample.of(output, seconds), self.running)
        elif self.slo is not None:
            self.slo.first_tokens(self.running, self._clock())

    @property
    def wants_step_timing(self) -> bool:
        """Whether `record_step` does anything (a planning policy or SLO targets): the engine times steps then."""
        return self._planner is not None or self.slo is not None

    # ------------------------------------------------- held sequences (beam search)

    def fork_sequence(self, parent_id: str, child_id: str) -> None:
        """Add `child_id`, a copy of `parent_id`'s tokens in the same group, sharing its KV blocks.

        A device-resident parent is forked in the allocator (every block shared by reference count, copy-on-write
        on the next write into the shared last block) and the child joins the running batch with the parent's
        computed tokens. A preempted parent has no device blocks to share: the child waits to be recomputed.
        The caller keeps the group within its seats (it frees pruned sequences first).
        """
        parent = self._requests[parent_id]
        if child_id in self._requests or child_id in self._reserved_ids:
            raise ValueError(f"sequence id {child_id!r} is already in use")
        child = parent.copy_as(child_id, parent_id=parent.group_id, sample_index=parent.sample_index)
        self._add_child(child)
        if parent.status is RUNNING:
            self.kv.fork(parent_id, child_id)
            child.status = RUNNING
            child.num_computed_tokens = child.chunk_start = parent.num_computed_tokens
            self.running.append(child)
        else:
            child.status = RequestStatus.PREEMPTED
            self.policy.enqueue(self.waiting, child, preempted=True)

    def append_token(self, seq_id: str, token_id: int) -> None:
        """Extend held sequence `seq_id` by `token_id` (no stop rule: the engine that held it decides)."""
        self._requests[seq_id].append_output_token(token_id)

    def finish_sequence(self, seq_id: str, status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        """Finish one sequence (a pruned or completed beam) in whatever queue it is, freeing its blocks now."""
        self._finish(self._requests[seq_id], status)

    # ----------------------------------------------------------------- helpers

    def _chunk_len(self, request: Request, num_computed: int, step: _Step) -> int:
        """Tokens to compute for `request` this step given the remaining budgets (0: not this step)."""
        num_new = request.num_tokens - num_computed
        budget = step.budget
        if num_new > 1 and step.prefill_budget is not None:  # a prefill: TGI's prefill budget caps it too
            budget = min(budget, step.prefill_budget)
        if not self.config.enable_chunked_prefill:
            return num_new if num_new <= budget else 0
        threshold = step.chunk_cap
        if threshold is not None and num_new > threshold:
            num_new = threshold
        num_new = min(num_new, budget)
        if request.encoder_spans:
            return _whole_spans(request, num_computed, num_new, budget)
        return num_new

    def _drafts(self, request: Request, budget: int) -> tuple[int, ...]:
        """The draft tokens a decode of `request` computes this step: what budget and stop rules leave room for."""
        spec = request.spec_token_ids
        if not spec or self._trim is None:
            return ()
        sp = request.sampling_params
        # The step may add 1 + k outputs: never past max_tokens or max_model_len (so never past the slots
        # add_request checked against the pool either).
        k = min(
            len(spec),
            budget - 1,
            sp.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return spec[:k] if k > 0 else ()

    def _check_accepted(self, sample_id: str, spec: tuple[int, ...], tokens: Sequence[int]) -> None:
        """ValueError unless `tokens` are accepted drafts (a prefix of `spec`) then one token after them."""
        if len(tokens) > 1 + len(spec) or tuple(tokens[:-1]) != spec[: len(tokens) - 1]:
            raise ValueError(
                f"sample {sample_id!r}: {len(tokens)} tokens are not a prefix of its {len(spec)} drafts "
                "then one sampled token"
            )

    def _roll_back(self, request: Request, num_rejected: int) -> None:
        """Take back the slots of `request`'s rejected draft positions (their KV is never read again)."""
        request.spec_token_ids = ()
        if num_rejected == 0 or self._trim is None:
            return
        request.num_computed_tokens -= num_rejected
        self._trim(request.request_id, request.num_computed_tokens)
        # Blocks may have gone from the end of the table: the next chunk asks the allocator again.
        self._block_tables.pop(request.request_id, None)

    def _schedule_running(
        self, request: Request, num_new: int, step: _Step, spec: tuple[int, ...] = ()
    ) -> None:
        """Give a running request its chunk, preempting policy-chosen victims until it fits (or is one).

        Drafts never preempt anyone: when the chunk with them does not fit, it is tried without them.
        """
        while True:
            # The token list excludes the drafts: their blocks are never hashed into the prefix cache.
            allocation = self.kv.allocate_slots(
                request.request_id, request.block_key_ids, num_new + len(spec), salt=request.cache_salt
            )
            if allocation is not None:
                self._emit(request, num_new + len(spec), allocation, step, spec)
                return
            if spec:
                spec = ()
                continue
            # A prefill chunk shrinks to the free blocks before it costs anyone their place: chunk boundaries
            # never change tokens, and a sliding-window group releases its blocks as the chunks advance.
            fitting = self._fitting_chunk(request, num_new, request.num_computed_tokens, 0)
            if 0 < fitting < num_new:
                num_new = fitting
                continue
            # Requests already scheduled this step hold allocations the runner will use: never victims.
            scheduled = {chunk.request_id for chunk in step.scheduled}
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = self.policy.select_victim(candidates)
            if victim not in candidates:
                raise ValueError(f"policy chose {victim.request_id!r}, not a preemption candidate")
            step.under_pressure = True
            self._preempt(victim, step, self._preemption_choice(victim))
            if victim is request:
                return

    def _preempt_for_waiting(self, step: _Step) -> None:
        """Preempt (by recompute) the running requests the policy gives up for its most urgent waiting request.

        Recompute, not swap: a swapped victim would return before any admission, ahead of the request it made
        room for. Only when nothing is swapped out, since admission waits for swapped requests anyway.
        """
        if self.swapped:
            return
        candidates = self.policy.admissible(self.waiting, self.num_running_seqs, self.config.max_num_seqs)
        if not candidates:
            return
        head = candidates[0]
        # The policy first: FCFS never preempts for a waiting request, and then the fit is not even checked.
        victim = self._victim_for(head, self.running)
        if victim is None or self._admission_chunk(head, step) is not None:
            return
        if not self._seats_free_up(head, step):
            return
        while victim is not None:
            self._preempt(victim, step, "recompute")
            if self._admission_chunk(head, step) is not None:
                return
            victim = self._victim_for(head, self.running)

    def _victim_for(self, head: Request, running: Sequence[Request]) -> Request | None:
        """The running request the policy gives up next for waiting `head` (None: it waits); ValueError if the
        policy names one that is not running."""
        victim = self.policy.preempt_for(head, running)
        if victim is not None and victim not in running:
            raise ValueError(f"policy chose {victim.request_id!r}, not a running request")
        return victim

    def _seats_free_up(self, head: Request, step: _Step) -> bool:
        """Whether the victims the policy would give up for `head` free enough of this step's seats for its
        samples (asked in turn, as the preemption loop will, only until they do). If not, preempting them would
        only throw their work away: an adaptive step's seats, planned with them decoding, can be fewer than a
        waiting request's samples (it was preempting a stream every other step and admitting nobody, found by
        the random traces)."""
        remaining = list(self.running)
        seats = self.num_running_seqs + head.num_seqs
        while seats > step.max_num_seqs:
            victim = self._victim_for(head, remaining)
            if victim is None:
                return False
            remaining.remove(victim)
            seats -= victim.num_seqs
        return True

    def _preemption_choice(self, victim: Request) -> PreemptionChoice:
        """The configured mode, or for "auto" the cheaper one for this victim by the cost model."""
        mode, costs = self.config.preemption_mode, self.preemption_costs
        if mode == "swap":
            return "swap"
        if mode == "recompute" or costs is None:
            return "recompute"
        rid = victim.request_id
        # Group 0's table length: the block positions a swap moves (an engine with several groups prices a
        # position as every group's block at it).
        return choose_preemption(costs, len(self.kv.block_table(rid)), self.kv.num_tokens(rid))

    def _preempt(self, victim: Request, step: _Step, mode: PreemptionChoice) -> None:
        """Swap `victim` out if `mode` says so and the host tier has room, else free it for recompute."""
        self._remove_running(victim)
        self._block_tables.pop(victim.request_id, None)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self._num_preemptions += 1
        step.preempted.append(victim.request_id)
        victim.spec_token_ids = ()
        rid = victim.request_id
        if mode == "swap" and self.kv.can_swap_out(rid):
            pairs = self.kv.swap_out(rid)
            if pairs is not None:
                step.swap_out.extend(pairs)
                self.policy.enqueue(self.swapped, victim, preempted=True)
                return
        # Recompute: outputs so far are kept and computed again as part of the prompt.
        self.kv.free(rid)
        victim.num_computed_tokens = 0
        self.policy.enqueue(self.waiting, victim, preempted=True)

    def _swap_in(self, step: _Step) -> None:
        """Bring swapped-out requests back while seats and blocks (above the watermark) allow; schedule them."""
        while self.swapped:
            request = self.swapped[0]
            rid = request.request_id
            blocks = self.kv.blocks_for_tokens(self.kv.num_tokens(rid))
            if self.num_running_seqs + request.num_seqs > step.max_num_seqs:
                break
            if not self._fits_rules(request):
                break
            if not self.kv.can_swap_in(rid):
                break
            if self.running and self.kv.num_free_blocks() - blocks < self._watermark_blocks:
                break
            is_prefill = request.num_tokens - request.num_computed_tokens > 1
            if is_prefill and not self._may_start_prefill(step):
                break
            pairs = self.kv.swap_in(rid)
            if pairs is None:
                break
            step.swap_in.extend(pairs)
            del self.swapped[0]
            self._add_running(request)
            step.num_prefills += is_prefill
            num_new = self._chunk_len(request, request.num_computed_tokens, step)
            if num_new:
                allocation = self.kv.allocate_slots(
                    rid, request.block_key_ids, num_new, salt=request.cache_salt
                )
                if allocation is not None:
                    self._emit(request, num_new, allocation, step)

    def _may_start_prefill(self, step: _Step) -> bool:
        """Whether one more request may be mid-prefill (max_num_partial_prefills)."""
        cap = self.config.max_num_partial_prefills
        return cap is None or step.num_prefills < cap

    def _admission_chunk(self, request: Request, step: _Step) -> tuple[int, int] | None:
        """(cached tokens, chunk length) of waiting `request` if seats, budgets and free blocks admit it now."""
        cfg, kv = self.config, self.kv
        if self.num_running_seqs + request.num_seqs > step.max_num_seqs or not self._may_start_prefill(step):
            return None
        num_cached = 0
        if cfg.enable_prefix_caching:
            # At least one token is always computed: its logits are needed.
            num_cached = kv.get_num_cached_tokens(
                request.block_key_ids, salt=request.cache_salt, max_tokens=request.num_tokens - 1
            )
        num_new = self._chunk_len(request, num_cached, step)
        if num_new == 0:
            return None
        # Leave a few blocks so running decodes do not preempt right away. Held sequences (beam search) compute
        # nothing until their engine extends them: with only those running, no decode needs the headroom, and the
        # exact allocation decides (else a beam waiting to be recomputed could wait forever on its parked siblings).
        computing = any(r.num_computed_tokens < r.num_tokens for r in self.running)
        reserve = self._watermark_blocks if computing else 0
        # With sliding windows the first chunk is a poor guide (a window holds chunk + window while it runs,
        # the window alone after): admit when the prompt's steady footprint fits, and let chunks shrink to the
        # headroom, so a request is not admitted only to be preempted before its prefill ends.
        if self._release_behind is not None and self.running:
            steady = kv.blocks_for_tokens(request.num_tokens)
            if kv.num_free_blocks() - reserve < steady:
                return None
        if computing:
            num_new = self._fitting_chunk(request, num_new, num_cached, reserve)
            if num_new == 0:
                return None
        return num_cached, num_new

    def _allocate_admitted(
        self, request: Request, num_cached: int, num_new: int
    ) -> tuple[SlotAllocationLike, int] | None:
        """Allocate waiting `request`'s first chunk, shortened to the free blocks if it does not fit whole;
        (allocation, chunk length), or None (nothing changed)."""
        length = num_new
        while length:
            allocation = self.kv.allocate_slots(
                request.request_id,
                request.block_key_ids,
                length,
                num_computed_tokens=num_cached,
                salt=request.cache_salt,
            )
            if allocation is not None:
                return allocation, length
            shorter = self._fitting_chunk(request, length, num_cached, 0)
            length = shorter if shorter < length else 0
        return None

    def _fitting_chunk(self, request: Request, num_new: int, num_computed: int, reserve: int) -> int:
        """The longest chunk of at most `num_new` tokens of `request` whose blocks fit in the free blocks less
        `reserve`; 0 when not even a block's worth of tokens fits (a shorter chunk would crawl).

        Only with chunked prefill, and never cutting an image: the chunk stays whole otherwise.
        """
        kv, rid = self.kv, request.request_id
        free = kv.num_free_blocks() - reserve

        def fits(n: int) -> bool:
            return kv.num_blocks_needed(rid, n, num_computed_tokens=num_computed) <= free

        if fits(num_new):
            return num_new
        shortest = min(num_new, self._block_size)
        if (
            not self.config.enable_chunked_prefill
            or request.encoder_spans
            or num_new <= 1
            or not fits(shortest)
        ):
            return 0
        # Blocks needed grow with the chunk's length: the longest that fits, by bisection.
        lo, hi = shortest, num_new - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def _admit(self, step: _Step) -> None:
        """Admit waiting requests in policy order while budgets, seats and free blocks allow."""
        candidates = list(
            self.policy.admissible(self.waiting, self.num_running_seqs, self.config.max_num_seqs)
        )
        # A request an admission rule holds back keeps its place, and the requests that rule says wait behind
        # it are held too (see `admission`); the others still pass.
        held_by: list[AdmissionRule] = []
        for request in candidates:
            if step.budget == 0:
                break
            # A request preempted this step for a more urgent one does not come back in the same step: a policy
            # whose admission order differs from its preemption order (adaptive's aged requests go before the lane
            # one of an earlier priority class) would otherwise readmit the victim ahead of the request it made room
            # for, every step, and neither would progress (found by the random traces).
            if request.request_id in step.preempted:
                continue
            if self.rules and not self._passes(request, held_by):
                continue
            chunk = self._admission_chunk(request, step)
            if chunk is None:
                break
            num_cached, num_new = chunk
            admitted = self._allocate_admitted(request, num_cached, num_new)
            if admitted is None:
                break
            allocation, num_new = admitted
            self.waiting.remove(request)
            request.num_computed_tokens = num_cached
            self._add_running(request)
            step.num_prefills += 1
            self._emit(request, num_new, allocation, step)

    def _fits_rules(self, request: Request) -> bool:
        """Whether every admission rule lets `request` join the running batch now."""
        return all(rule.fits(request, self.running) for rule in self.rules)

    def _passes(self, request: Request, held_by: list[AdmissionRule]) -> bool:
        """One admission pass's check of `request`: False if a rule that held an earlier request holds it behind
        that one, or a rule does not fit it (that rule is then added to `held_by`)."""
        if any(rule.holds_behind(request) for rule in held_by):
            return False
        for rule in self.rules:
            if not rule.fits(request, self.running):
                held_by.append(rule)
                return False
        return True

    def _emit(
        self,
        request: Request,
        num_new: int,
        allocation: SlotAllocationLike,
        step: _Step,
        spec: tuple[int, ...] = (),
    ) -> None:
        """Record `request`'s chunk (its `spec` drafts last) in the step and advance its computed tokens."""
        # Hot path (once per request per step): plain locals, no work for what is empty.
        rid = request.request_id
        start = request.chunk_start = request.num_computed_tokens
        end = start + num_new
        tokens = request.all_token_ids
        if end < len(tokens):
            sample_ids: tuple[str, ...] = ()
        elif request.num_children_to_fork:
            sample_ids = (rid, *request.child_ids())
        else:
            sample_ids = (rid,)
        if spec:
            chunk_ids = (*tokens[start:], *spec)
            step.spec[rid] = spec
        else:
            chunk_ids = tuple(tokens[start:end])
        request.spec_token_ids = spec
        if self._grouped:
            chunk = self._grouped_chunk(request, start, num_new, allocation, sample_ids, chunk_ids, spec)
            step.scheduled.append(chunk)
        else:
            table = self._block_tables.get(rid)
            if table is None or allocation.copies or len(table) * self._block_size < end:
                table = self._block_tables[rid] = tuple(self.kv.block_table(rid))
            step.scheduled.append(
                ScheduledRequest(
                    rid,
                    chunk_ids,
                    start,
                    num_new,
                    table,
                    tuple(allocation.slots),
                    len(sample_ids),
                    sample_ids,
                    spec_token_ids=spec,
                    lora_id=request.lora_id,
                )
            )
        if allocation.copies:
            step.copies.extend(allocation.copies)
        step.budget -= num_new
        if step.prefill_budget is not None and start + 1 < len(tokens):  # not a decode
            step.prefill_budget -= num_new
        request.num_computed_tokens = end

    def _grouped_chunk(
        self,
        request: Request,
        start: int,
        num_new: int,
        allocation: SlotAllocationLike,
        sample_ids: tuple[str, ...],
        chunk_ids: tuple[int, ...],
        spec: tuple[int, ...],
    ) -> ScheduledRequest:
        """A chunk with every KV cache group's table and slots, read fresh (a window changes a table anywhere)."""
        tables = tuple(tuple(t) for t in self.kv.block_tables(request.request_id))
        group_slots = tuple(tuple(s) for s in allocation.group_slots)
        return ScheduledRequest(
            request.request_id,
            chunk_ids,
            start,
            num_new,
            tables[0],
            tuple(allocation.slots),
            len(sample_ids),
            sample_ids,
            tables if len(tables) > 1 else (),
            group_slots,
            lora_id=request.lora_id,
            spec_token_ids=spec,
        )

    def _fork(self, parent: Request) -> None:
        """Make the parent's n - 1 children, sharing its computed prompt blocks (copy-on-write)."""
        pid = parent.request_id
        for index, child_id in enumerate(parent.child_ids(), start=1):
            self.kv.fork(pid, child_id)
            child = parent.copy_as(child_id, parent_id=pid, sample_index=index)
            child.status = RUNNING
            child.num_computed_tokens = child.chunk_start = parent.num_computed_tokens
            self._reserved_ids.discard(child_id)
            self._add_child(child)
            self.running.append(child)
        self._num_pending_forks -= parent.num_children_to_fork
        parent.num_children_to_fork = 0

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        """Finished status after appending `token`, if any (a stop token wins over the length cap)."""
        sp = request.sampling_params
        num_output = request.num_output_tokens
        if token in sp.stop_token_ids and num_output >= sp.min_tokens:
            request.stop_token_id = token
            return RequestStatus.FINISHED_STOPPED
        if num_output >= sp.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Take `request` out of its queue, free its blocks, and mark it finished with `status`."""
        rid = request.request_id
        if request.status is RUNNING:
            self._remove_running(request)
        elif request in self.swapped:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        if self.kv.has_seq(rid) or self.kv.is_swapped(rid):
            self.kv.free(rid)
        self._block_tables.pop(rid, None)
        self._reserved_ids.difference_update(request.child_ids())
        request.num_children_to_fork = 0
        request.status = status
        del self._requests[rid]
        if self._planner is not None:
            self._planner.request_finished(request, aborted=status is RequestStatus.FINISHED_ABORTED)
        elif self.slo is not None:
            self.slo.finished(request, self._clock(), aborted=status is RequestStatus.FINISHED_ABORTED)
        if request.parent_id is not None:
            siblings = self._children[request.parent_id]
            del siblings[rid]
            if not siblings:
                del self._children[request.parent_id]
        self._finished_ids.append(rid)

    def _add_child(self, child: Request) -> None:
        """Register a forked sequence (its `parent_id` is its group's id) in the request map and the index."""
        group = child.parent_id
        if group is None:
            raise ValueError(f"{child.request_id!r} is not a forked sequence")
        self._requests[child.request_id] = child
        self._children.setdefault(group, {})[child.request_id] = None

    def _add_running(self, request: Request) -> None:
        """Put `request` into the running batch."""
        request.status = RUNNING
        self.running.append(request)
        self._num_pending_forks += request.num_children_to_fork

    def _remove_running(self, request: Request) -> None:
        """Take `request` out of the running batch."""
        self.running.remove(request)
        self._num_pending_forks -= request.num_children_to_fork

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """AssertionError if queues, statuses, seats or the allocator's view of any request disagree."""
        kv = self.kv
        queued = [*self.waiting, *self.running, *self.swapped]
        assert len({r.request_id for r in queued}) == len(queued), "a request sits in two queues"
        assert {r.request_id for r in queued} == self._requests.keys(), "queues and the request map disagree"
        assert self.num_running_seqs <= self.config.max_num_seqs, "too many running sequences"
        assert self._num_pending_forks == sum(r.num_children_to_fork for r in self.running), "fork seat count"
        assert self._block_tables.keys() <= {r.request_id for r in self.running}, "stale block table"
        for r in self.running:
            assert r.status is RUNNING and kv.has_seq(r.request_id), r
            sent = self._block_tables.get(r.request_id)
            assert sent is None or sent == tuple(kv.block_table(r.request_id)), r
            # Equal only between schedule() and update_from_output(), for a chunk that completes the sequence;
            # scheduled drafts count as computed until the update rolls the rejected ones back.
            assert (
                kv.num_tokens(r.request_id) == r.num_computed_tokens <= r.num_tokens + len(r.spec_token_ids)
            ), r
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
            assert r.num_computed_tokens == 0 and not kv.has_seq(r.request_id), r
            assert not kv.is_swapped(r.request_id), r
        for r in self.swapped:
            assert r.status is RequestStatus.PREEMPTED and kv.is_swapped(r.request_id), r
            # Equal for a held sequence (beam search) swapped out while it waits for its token.
            assert kv.num_tokens(r.request_id) == r.num_computed_tokens <= r.num_tokens, r
        for rid in self._reserved_ids:
            assert rid not in self._requests, rid
        index: dict[str, list[str]] = {}
        for r in self._requests.values():
            if r.parent_id is not None:
                index.setdefault(r.parent_id, []).append(r.request_id)
        assert {g: list(c) for g, c in self._children.items()} == index, "the children index is stale"


def _whole_spans(request: Request, num_computed: int, num_new: int, budget: int) -> int:
    """A chunk length from `num_computed` that does not end inside an atomic span: cut back to the span's start,
    or, for a chunk starting at or in the span, stretched to its end when the budget allows (else 0: not now)."""
    end = num_computed + num_new
    for span in request.encoder_spans:
        if not span.atomic or not span.offset < end < span.end:
            continue
        if span.offset > num_computed:
            return span.offset - num_computed
        return span.end - num_computed if span.end - num_computed <= budget else 0
    return num_new
