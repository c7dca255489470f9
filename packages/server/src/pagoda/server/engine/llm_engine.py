"""The engine: one step is schedule -> execute -> sample -> update, plus the bookkeeping around it."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar as xgr
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    FCFSPolicy,
    PriorityPolicy,
    Request,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagoda.server.config import EngineConfig
from pagoda.server.engine.admission import AdmissionRules, RequestRejectedError
from pagoda.server.engine.model_runner import ModelRunner
from pagoda.server.engine.requests import RequestState, SchedulerParams
from pagoda.server.engine.setup import EngineParts, build_parts
from pagoda.server.outputs import EngineStats, RequestOutput
from pagoda.server.sampling import Sampler, TokenLogprobs
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.structured import GrammarBitmask, GrammarError, StructuredOutputManager
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# How long an idle step waits for a compiling grammar before returning to the caller's command loop.
_GRAMMAR_POLL_SECONDS = 0.01


@dataclass(slots=True)
class TokenCounters:
    """The engine's cumulative token counts, for /metrics."""

    # Prompt tokens computed: prefix-cache hits excluded, recomputed ones counted again.
    prompt_tokens: int = 0
    generation_tokens: int = 0  # tokens sampled

    def count_chunk(self, chunk: ScheduledRequest, num_prompt_tokens: int) -> None:
        """Count the prompt tokens a scheduled chunk computes."""
        self.prompt_tokens += max(0, min(chunk.seq_len, num_prompt_tokens) - chunk.start)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache; drive it with add_request / step."""

    def __init__(self, config: EngineConfig, parts: EngineParts) -> None:
        self.config = config
        self.tokenizer: PreTrainedTokenizerBase = parts.tokenizer
        self.model_name = parts.model_name
        self.model_path: Path = parts.model_path
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.vocab_size
        self.num_kv_blocks = parts.kv_cache.num_blocks
        self.block_size = config.block_size
        self.device = parts.device
        self.dtype = parts.dtype
        self.eos_token_ids = parts.eos_token_ids
        self.rules = AdmissionRules(parts.max_model_len, parts.vocab_size)
        self.kv_manager = BlockManager(
            parts.kv_cache.num_blocks,
            config.block_size,
            num_host_blocks=parts.kv_cache.num_host_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=parts.max_num_batched_tokens,
                max_model_len=parts.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                enable_prefix_caching=config.enable_prefix_caching,
                preemption_mode=config.preemption_mode,
            ),
            self.kv_manager,
            PriorityPolicy() if config.scheduling_policy == "priority" else FCFSPolicy(),
        )
        self.runner = ModelRunner(parts.model, parts.kv_cache, parts.backend, parts.device)
        self.sampler = Sampler()
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.grammar_bitmask = GrammarBitmask(self.vocab_size, self.eos_token_ids)
        # Constrained requests whose grammar is compiling: held back from the scheduler until it is ready, so
        # that no step waits on a compilation and the scheduler never sees a request it cannot run.
        self._waiting_for_grammar: dict[str, tuple[Request, Future[xgr.CompiledGrammar]]] = {}
        self._requests: dict[str, RequestState] = {}  # unfinished user requests by id
        self._seq_owner: dict[str, RequestState] = {}  # scheduler sequence id -> its user request
        # Final snapshots of aborted requests, returned by the next step.
        self._aborted: list[RequestOutput] = []
        self.counters = TokenCounters()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model, size the KV cache and build the engine (EngineConfigError if it cannot serve)."""
        return cls(config, build_parts(config))

    # ---------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; RequestRejectedError (with `param`) if it can never run."""
        ids = tuple(prompt_token_ids)
        self.rules.check(ids, params)
        constraint = params.structured_outputs
        if constraint is not None:
            try:
                self.structured.check(constraint)
            except GrammarError as exc:
                field = "structured_outputs" if exc.kind is None else f"structured_outputs.{exc.kind}"
                raise RequestRejectedError(str(exc), field) from exc
        if request_id in self._requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use", "request_id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        scheduler_params = SchedulerParams.from_params(params, self.eos_token_ids)
        state = RequestState(
            request_id,
            prompt,
            ids,
            params,
            scheduler_params.stop_token_ids,
            self.tokenizer,
            arrival,
            self.device,
        )
        request = Request(request_id, ids, scheduler_params, arrival_time=arrival)
        if constraint is None:
            # The scheduler refuses what can never fit the KV pool or the batch, naming the field.
            self.scheduler.add_request(request)
        else:
            self._waiting_for_grammar[request_id] = (request, self.structured.compile(constraint))
        self._requests[request_id] = state
        self._seq_owner.update(dict.fromkeys(state.samples, state))

    def abort_request(self, request_id: str) -> None:
        """Abort a request in any state, freeing its KV blocks now; unknown or finished ids are ignored."""
        state = self._requests.get(request_id)
        if state is None:
            return
        waiting = self._waiting_for_grammar.pop(request_id, None)
        if waiting is not None:
            waiting[1].cancel()
        else:
            self.scheduler.abort_request(request_id)
        for seq_id in state.samples:
            state.finish(seq_id, "abort")
        self._aborted.append(state.snapshot())
        self._forget(state)

    def has_unfinished_requests(self) -> bool:
        """Whether any request still waits, runs, or has an undelivered abort."""
        return bool(self._requests) or bool(self._aborted)

    def get_num_unfinished_requests(self) -> int:
        """User requests not finished yet."""
        return len(self._requests)

    # -------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one engine step; snapshots of the requests that progressed, finished or were aborted."""
        self._admit_compiled()
        outputs, self._aborted = self._aborted, []
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self._waiting_for_grammar:  # nothing to run until a grammar is ready: wait, do not spin
                futures = [future for _, future in self._waiting_for_grammar.values()]
                wait(futures, timeout=_GRAMMAR_POLL_SECONDS, return_when=FIRST_COMPLETED)
            return outputs
        logits = self.runner.execute(scheduled)
        sampled = self._sample(scheduled, logits)
        return outputs + self._update(scheduled, sampled)

    def _sample(
        self,
        scheduled: SchedulerOutput,
        logits: torch.Tensor,  # [num_rows, vocab]: one row per sample id of the step, in schedule order
    ) -> list[tuple[str, int, TokenLogprobs | None]]:
        """Draw the next token of every sample the step completes: (sample id, token id, logprobs)."""
        seq_ids = [seq_id for chunk in scheduled.scheduled for seq_id in chunk.sample_ids]
        if not seq_ids:
            return []
        samples = [self._seq_owner[seq_id].samples[seq_id] for seq_id in seq_ids]
        # The grammar step comes first, so that penalties, temperature, top-k and top-p see only allowed tokens.
        self.grammar_bitmask.apply(logits, [sample.matcher for sample in samples])
        out = self.sampler(logits, [self._seq_owner[seq_id].sampling_row(seq_id) for seq_id in seq_ids])
        return list(zip(seq_ids, out.token_ids, out.logprobs, strict=True))

    def _update(
        self, scheduled: SchedulerOutput, sampled: list[tuple[str, int, TokenLogprobs | None]]
    ) -> list[RequestOutput]:
        """Record the sampled tokens (finding stop strings), apply the scheduler's stop rules, snapshot."""
        now = time.monotonic()
        for chunk in scheduled.scheduled:
            state = self._seq_owner[chunk.request_id]
            state.mark_scheduled(chunk.start, now)
            self.counters.count_chunk(chunk, len(state.prompt_token_ids))
        progressed: dict[str, RequestState] = {}
        stopped: dict[str, str] = {}  # sequence id -> the stop string its new token completed
        for seq_id, token, logprobs in sampled:
            state = self._seq_owner[seq_id]
            stop = state.add_token(seq_id, token, logprobs, now)
            if stop is not None:
                stopped[seq_id] = stop
            progressed[state.request_id] = state
        self.counters.generation_tokens += len(sampled)
        tokens = {seq_id: [token] for seq_id, token, _ in sampled}
        for request in self.scheduler.update_from_output(scheduled, tokens, stopped):
            state = self._seq_owner[request.request_id]
            state.finish_as_scheduled(request, stopped.get(request.request_id))
            progressed[state.request_id] = state
        outputs = [state.snapshot() for state in progressed.values()]
        for state in progressed.values():
            if state.finished:
                self._forget(state)
        return outputs

    def _admit_compiled(self) -> None:
        """Hand the requests whose grammar finished compiling to the scheduler, each sample with its matcher."""
        for request_id, (request, future) in list(self._waiting_for_grammar.items()):
            if not future.done():
                continue
            del self._waiting_for_grammar[request_id]
            state = self._requests[request_id]
            try:
                state.start_grammar(future.result())
                self.scheduler.add_request(request)
            except Exception:  # the constraint was checked at add_request, so this is the engine's failure
                logger.exception("request %s: its grammar could not be compiled or admitted", request_id)
                for seq_id in state.samples:
                    state.finish(seq_id, "abort")
                self._aborted.append(state.snapshot())
                self._forget(state)

    def _forget(self, state: RequestState) -> None:
        """Drop a finished or aborted request's bookkeeping."""
        self._requests.pop(state.request_id, None)
        for seq_id in state.samples:
            self._seq_owner.pop(seq_id, None)

    # ------------------------------------------------------------------- stats

    def get_stats(self) -> EngineStats:
        """Gauges and counters for /metrics."""
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting + len(self._waiting_for_grammar),
            num_swapped=s.num_swapped,
            kv_cache_usage=s.kv_usage,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens,
        )
