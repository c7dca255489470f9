"""The engine: one step is schedule -> execute -> sample -> update, plus the bookkeeping around it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    FCFSPolicy,
    PriorityPolicy,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagoda.scheduler import (
    RequestRejectedError as SchedulerRejectedError,
)
from pagoda.server.config import EngineConfig
from pagoda.server.engine.model_runner import ModelRunner
from pagoda.server.engine.requests import RequestState, SchedulerParams
from pagoda.server.engine.setup import EngineParts, build_parts
from pagoda.server.outputs import EngineStats, RequestOutput
from pagoda.server.sampling import Sampler, SamplingRow
from pagoda.server.sampling_params import SamplingParams
from transformers import PreTrainedTokenizerBase


class RequestRejectedError(ValueError):
    """A request that can never run (too long, too many blocks, bad token ids); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
        self._requests: dict[str, RequestState] = {}  # unfinished user requests by id
        self._seq_owner: dict[str, RequestState] = {}  # scheduler sequence id -> its user request
        self._aborted: list[
            RequestOutput
        ] = []  # final snapshots of aborted requests, returned by the next step
        self._prompt_tokens = 0
        self._generation_tokens = 0

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
        if not ids:
            raise RequestRejectedError("the prompt is empty", "prompt")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejectedError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt"
            )
        if len(ids) > self.max_model_len:
            raise RequestRejectedError(
                f"the prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})", "prompt"
            )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestRejectedError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.max_model_len})",
                "max_tokens",
            )
        if request_id in self._requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use", "request_id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, prompt, ids, params, self.tokenizer, arrival, self.device)
        scheduler_params = SchedulerParams.from_params(params, self.eos_token_ids)
        state.stop_token_ids = scheduler_params.stop_token_ids
        request = Request(request_id, ids, scheduler_params, arrival_time=arrival)
        try:
            self.scheduler.add_request(request)
        except SchedulerRejectedError as error:
            raise RequestRejectedError(str(error), "max_tokens") from error
        self._requests[request_id] = state
        self._seq_owner.update(dict.fromkeys(state.samples, state))

    def abort_request(self, request_id: str) -> None:
        """Abort a request in any state, freeing its KV blocks now; unknown or finished ids are ignored."""
        state = self._requests.get(request_id)
        if state is None:
            return
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
        outputs, self._aborted = self._aborted, []
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return outputs
        logits = self.runner.execute(scheduled)
        now = time.monotonic()
        sampled, stopped, progressed = self._sample(scheduled, logits, now)
        finished = self.scheduler.update_from_output(scheduled, sampled, stopped)
        for request in finished:
            state = self._seq_owner[request.request_id]
            if request.request_id in stopped:  # a stop string wins over a length cap on the same token
                state.finish(request.request_id, "stop", stopped[request.request_id])
            elif request.finish_reason == "stop":
                state.finish(request.request_id, "stop", request.stop_token_id)
            else:
                state.finish(request.request_id, "length")
            progressed[state.request_id] = state
        for state in progressed.values():
            outputs.append(state.snapshot())
            if state.finished:
                self._forget(state)
        return outputs

    def _sample(
        self, scheduled: SchedulerOutput, logits: torch.Tensor, now: float
    ) -> tuple[dict[str, list[int]], dict[str, str], dict[str, RequestState]]:
        """Draw every sample of the step; detokenize and find stop strings."""
        rows: list[SamplingRow] = []
        seq_ids: list[str] = []
        progressed: dict[str, RequestState] = {}
        for chunk in scheduled.scheduled:
            state = self._seq_owner[chunk.request_id]
            if state.metrics.first_scheduled_time is None:
                # Admission starts a request at its prefix-cache hit: the tokens it did not compute.
                state.num_cached_tokens = chunk.start
                state.touch(first_scheduled_time=now)
            computed_prompt = max(0, min(chunk.seq_len, len(state.prompt_token_ids)) - chunk.start)
            self._prompt_tokens += computed_prompt
            for seq_id in chunk.sample_ids:
                sample = state.samples[seq_id]
                rows.append(
                    SamplingRow(
                        params=state.params,
                        prompt_token_ids=state.prompt_token_ids,
                        output_token_ids=sample.token_ids,
                        generator=sample.generator,
                        stop_token_ids=state.stop_token_ids,
                    )
                )
                seq_ids.append(seq_id)
        if not rows:
            return {}, {}, progressed
        out = self.sampler(logits, rows)
        sampled: dict[str, list[int]] = {}
        stopped: dict[str, str] = {}  # sequence id -> the stop string its new token completed
        for seq_id, token, logprobs in zip(seq_ids, out.token_ids, out.logprobs, strict=True):
            state = self._seq_owner[seq_id]
            sample = state.samples[seq_id]
            # The scheduler stops on it once the output, this token included, reaches min_tokens.
            is_stop = token in state.stop_token_ids and len(sample.token_ids) + 1 >= state.params.min_tokens
            stop = sample.add(token, logprobs, is_stop_token=is_stop)
            sampled[seq_id] = [token]
            self._generation_tokens += 1
            if stop is not None:
                stopped[seq_id] = stop
            state.touch(first_token_time=now, last_token_time=now)
            progressed[state.request_id] = state
        return sampled, stopped, progressed

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
            num_waiting=s.num_waiting,
            num_swapped=s.num_swapped,
            kv_cache_usage=s.kv_usage,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
        )
