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
from pagoda.pagedkernel.sampling import SampleStatus
from pagoda.scheduler import (
    KVBlockManager,
    Request,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)
from pagoda.server.config import EngineConfig, resolved_scheduler_config
from pagoda.server.engine.admission import AdmissionRules, RequestRejectedError
from pagoda.server.engine.beams import BeamGroup
from pagoda.server.engine.executor import Executor, UniProcExecutor, build_executor
from pagoda.server.engine.model_runner import ModelRunner
from pagoda.server.engine.preemption_costs import measure_preemption_costs
from pagoda.server.engine.requests import RequestState, SchedulerParams
from pagoda.server.engine.scheduling import build_kv_manager
from pagoda.server.engine.setup import EngineParts
from pagoda.server.outputs import EngineStats, RequestOutput
from pagoda.server.sampling import Sampler, TokenLogprobs, unseeded_seed
from pagoda.server.sampling.logits_processors import apply_logits_processors
from pagoda.server.sampling.logprobs import compute_logprobs
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.structured import FilledBitmask, GrammarBitmask, GrammarError, StructuredOutputManager
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Why the sampling op could not draw a row, as the engine's log says it.
_SAMPLE_FAILURES = {
    SampleStatus.NONFINITE: "the model produced NaN or +inf logits",
    SampleStatus.NO_TOKEN: "every token is masked (-inf logits after logit_bias, allowed_token_ids, bad_words)",
}

# How long an empty step waits when requests are held back by the policy (static batching's timeout).
_IDLE_WAIT_S = 0.001
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


# Prompt logprobs run the LM head over this many prompt positions at a time: [rows, vocab] float32 logits are
# 1 GiB per 1,024 rows of a 262k vocabulary.
_PROMPT_LOGITS_SLICE = 256


class LLMEngine:
    """Continuous-batching engine over a paged KV cache; drive it with add_request / step."""

    def __init__(self, config: EngineConfig, parts: EngineParts, executor: Executor | None = None) -> None:
        self.config = config
        self.tokenizer: PreTrainedTokenizerBase = parts.tokenizer
        self.model_name = parts.model_name
        self.model_path: Path = parts.model_path
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.vocab_size
        # The model side: the whole model here, or tensor-parallel ranks whose rank 0 runs here (`executor.driver`).
        self.executor = executor or UniProcExecutor(
            ModelRunner(parts.model, parts.kv_cache, parts.backend, parts.device)
        )
        self.runner = self.executor.driver
        self.num_kv_blocks = self.executor.num_blocks
        self.num_host_kv_blocks = self.executor.num_host_blocks
        self.block_size = config.cache_config.block_size
        self.device = parts.device
        self.dtype = parts.dtype
        self.eos_token_ids = parts.eos_token_ids
        model_config = config.model_config
        self.rules = AdmissionRules(parts.max_model_len, parts.vocab_size, model_config.max_input_tokens)
        self.kv_manager: KVBlockManager = build_kv_manager(
            config, self.num_kv_blocks, self.num_host_kv_blocks, parts.max_model_len
        )
        # The scheduler section itself, with the limits only the loaded model could tell.
        scheduler_config = resolved_scheduler_config(
            config.scheduler_config,
            max_model_len=parts.max_model_len,
            max_num_batched_tokens=parts.max_num_batched_tokens,
            kv_manager=config.cache_config.kv_manager,
        )
        costs = None
        if scheduler_config.preemption_mode == "auto":
            costs = measure_preemption_costs(self.executor, parts.max_num_batched_tokens, parts.max_model_len)
        self.scheduler = Scheduler(scheduler_config, self.kv_manager, preemption_costs=costs)
        # The op's backend follows the engine's kernel backend (cpu -> C, triton / cupy -> Triton, torch -> torch).
        self.sampler = Sampler(parts.backend.name, parts.device)
        self._unseeded_requests = 0  # numbers the unseeded requests, whose RNG seeds derive from config.seed
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.grammar_bitmask = GrammarBitmask(self.vocab_size, self.eos_token_ids)
        # Constrained requests whose grammar is compiling: held back from the scheduler until it is ready, so
        # that no step waits on a compilation and the scheduler never sees a request it cannot run.
        self._waiting_for_grammar: dict[str, tuple[Request, Future[xgr.CompiledGrammar]]] = {}
        self._requests: dict[str, RequestState] = {}  # unfinished user requests by id
        self._seq_owner: dict[str, RequestState] = {}  # scheduler sequence id -> its user request
        self._beam_groups: dict[str, BeamGroup] = {}  # unfinished beam-search requests by id
        self._beam_owner: dict[str, BeamGroup] = {}  # running beam's sequence id -> its group
        # Final snapshots of aborted requests, returned by the next step.
        self._aborted: list[RequestOutput] = []
        self.counters = TokenCounters()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model, size the KV cache and build the engine (EngineConfigError if it cannot serve); with
        tensor_parallel_size > 1 the model is split over that many ranks (see `pagoda.server.engine.executor`)."""
        executor, parts = build_executor(config)
        try:
            return cls(config, parts, executor)
        except BaseException:
            executor.shutdown()
            raise

    def close(self) -> None:
        """Stop the executor's workers (tensor parallelism); the engine serves no step afterwards."""
        self.executor.shutdown()

    def check_health(self) -> None:
        """Raise if the engine can serve no more steps (a tensor-parallel worker ended); cheap."""
        self.executor.check_health()

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
        if request_id in self._requests or request_id in self._beam_groups:
            raise RequestRejectedError(f"request id {request_id!r} is already in use", "request_id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        scheduler_params = SchedulerParams.from_params(params, self.eos_token_ids)
        if params.beam_search is not None:
            group = BeamGroup(
                request_id,
                prompt,
                ids,
                params.beam_search,
                params.n,
                self.eos_token_ids,
                params.skip_special_tokens,
                arrival,
            )
            self.scheduler.add_request(Request(request_id, ids, scheduler_params, arrival_time=arrival))
            self._beam_groups[request_id] = group
            self._beam_owner.update(dict.fromkeys(group.beams, group))
            return
        state = RequestState(
            request_id,
            prompt,
            ids,
            params,
            scheduler_params.stop_token_ids,
            self.tokenizer,
            arrival,
            self._request_seed(params),
        )
        # Prompt logprobs need every prompt position computed: a private cache salt keeps the prefix cache from
        # skipping any (vLLM skips the cache for these requests too).
        salt = None if params.prompt_logprobs is None else f"prompt-logprobs:{request_id}"
        request = Request(request_id, ids, scheduler_params, arrival_time=arrival, cache_salt=salt)
        if constraint is None:
            # The scheduler refuses what can never fit the KV pool or the batch, naming the field.
            self.scheduler.add_request(request)
        else:
            self._waiting_for_grammar[request_id] = (request, self.structured.compile(constraint))
        self._requests[request_id] = state
        self._seq_owner.update(dict.fromkeys(state.samples, state))

    def _request_seed(self, params: SamplingParams) -> int:
        """The request's own seed, or the next unseeded request's, derived from the engine's `--seed`."""
        if params.seed is not None:
            return params.seed
        self._unseeded_requests += 1
        return unseeded_seed(self.config.model_config.seed, self._unseeded_requests)

    def abort_request(self, request_id: str) -> None:
        """Abort a request in any state, freeing its KV blocks now; unknown or finished ids are ignored."""
        group = self._beam_groups.pop(request_id, None)
        if group is not None:
            self.scheduler.abort_request(request_id)
            for seq_id in group.beams:
                self._beam_owner.pop(seq_id, None)
            return
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
        return bool(self._requests) or bool(self._beam_groups) or bool(self._aborted)

    def get_num_unfinished_requests(self) -> int:
        """User requests not finished yet."""
        return len(self._requests) + len(self._beam_groups)

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
            elif not outputs and self.scheduler.has_unfinished_requests():
                # The policy holds the waiting requests back (a static batch still forming): a step loop
                # would spin on this, so yield the core for a moment.
                time.sleep(_IDLE_WAIT_S)
            return outputs
        prompt_lens = {
            chunk.request_id: len(state.prompt_token_ids)
            for chunk in scheduled.scheduled
            # Beam sequences have no RequestState (their group scores its own rows).
            if (state := self._seq_owner.get(chunk.request_id)) is not None and state.wants_prompt_logprobs
        }
        # The grammar masks depend only on the tokens accepted so far: they fill while the model runs.
        grammar = self.grammar_bitmask.start_fill(self._step_matchers(scheduled))
        logits, prompt_hidden = self.executor.execute(scheduled, prompt_lens)
        for request_id, rows in prompt_hidden.items():
            self._add_prompt_logprobs(self._seq_owner[request_id], rows.start, rows.hidden)
        sampled, failed = self._sample(scheduled, logits, grammar)
        for state in failed:
            self.scheduler.abort_request(state.request_id)  # its rows get no token: the update skips them
        outputs += self._update(scheduled, sampled)
        for state in failed:
            for seq_id in state.samples:
                state.finish(seq_id, "abort")
            outputs.append(state.snapshot())
            self._forget(state)
        return outputs

    def _add_prompt_logprobs(
        self,
        state: RequestState,
        start: int,
        hidden: torch.Tensor,  # [num_positions, hidden_size]: positions start, start + 1, ...
    ) -> None:
        """Score the prompt tokens after these positions, from the raw logits, a slice at a time."""
        k = state.params.prompt_logprobs or 0
        for lo in range(0, hidden.shape[0], _PROMPT_LOGITS_SLICE):
            part = hidden[lo : lo + _PROMPT_LOGITS_SLICE]
            logits = self.executor.compute_logits(part).float()
            first = start + lo + 1
            targets = torch.tensor(
                state.prompt_token_ids[first : first + part.shape[0]], dtype=torch.long, device=logits.device
            )
            scored = compute_logprobs(logits, targets, [k] * part.shape[0])
            state.add_prompt_logprobs(start + lo, [lp for lp in scored if lp is not None])

    def _step_matchers(self, scheduled: SchedulerOutput) -> list[xgr.GrammarMatcher | None]:
        """The grammar state of each row `_sample` samples (beam rows apart), in order; None: unconstrained."""
        return [
            self._seq_owner[seq_id].samples[seq_id].matcher
            for chunk in scheduled.scheduled
            for seq_id in chunk.sample_ids
            if seq_id not in self._beam_owner
        ]

    def _sample(
        self,
        scheduled: SchedulerOutput,
        logits: torch.Tensor,  # [num_rows, vocab]: one row per sample id of the step, in schedule order
        grammar: Future[FilledBitmask] | None,  # the step's grammar masks, filling (None: no constrained row)
    ) -> tuple[list[tuple[str, int, TokenLogprobs | None]], list[RequestState]]:
        """Draw the next token of every sample the step completes: (sample id, token id, logprobs), and the
        requests a row of which could not be sampled (each is logged; the caller aborts them, the rest go on)."""
        seq_ids = [seq_id for chunk in scheduled.scheduled for seq_id in chunk.sample_ids]
        if not seq_ids:
            return [], []
        beam_rows = [i for i, seq_id in enumerate(seq_ids) if seq_id in self._beam_owner]
        if beam_rows:
            seq_ids, logits = self._hold_beam_rows(seq_ids, logits, beam_rows)
            if not seq_ids:
                return [], []
        owners = [self._seq_owner[seq_id] for seq_id in seq_ids]
        # The grammar step comes first, so that penalties, temperature, top-k and top-p see only allowed tokens.
        grammar_failed = self.grammar_bitmask.apply(logits, grammar)
        # logit_bias, allowed_token_ids and bad_words edit a copy; logprobs stay those of the raw logits.
        processed = apply_logits_processors(
            logits, [owner.logits_edits(seq_id) for owner, seq_id in zip(owners, seq_ids, strict=True)]
        )
        rows = [owner.sampling_row(seq_id) for owner, seq_id in zip(owners, seq_ids, strict=True)]
        out = self.sampler(processed, rows, raw_logits=None if processed is logits else logits)
        failed: dict[str, RequestState] = {}
        for row in grammar_failed:
            logger.error(
                "request %s aborted: its grammar failed at sample %s", owners[row].request_id, seq_ids[row]
            )
            failed[owners[row].request_id] = owners[row]
        for row, status in out.failed.items():
            owner = owners[row]
            if owner.request_id not in failed:
                logger.error(
                    "request %s aborted: cannot sample sample %s's next token: %s",
                    owner.request_id,
                    seq_ids[row],
                    _SAMPLE_FAILURES[status],
                )
            failed[owner.request_id] = owner
        sampled = [
            entry
            for entry, owner in zip(
                zip(seq_ids, out.token_ids, out.logprobs, strict=True), owners, strict=True
            )
            if owner.request_id not in failed
        ]
        return sampled, list(failed.values())

    def _hold_beam_rows(
        self,
        seq_ids: list[str],
        logits: torch.Tensor,  # [num_rows, vocab]
        beam_rows: list[int],
    ) -> tuple[list[str], torch.Tensor]:  # the other rows' sample ids and [num_other_rows, vocab] logits
        """Give beam groups their rows' log-probabilities (float32, as transformers scores them); the rest."""
        index = torch.tensor(beam_rows, dtype=torch.int64, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1).cpu()
        for row, logprob in zip(beam_rows, logprobs, strict=True):
            self._beam_owner[seq_ids[row]].add_row(seq_ids[row], logprob)
        beam = set(beam_rows)
        others = [i for i in range(len(seq_ids)) if i not in beam]
        index = torch.tensor(others, dtype=torch.int64, device=logits.device)
        return [seq_ids[i] for i in others], logits.index_select(0, index)

    def _advance_beams(self, scheduled: SchedulerOutput, now: float) -> list[RequestOutput]:
        """Step every beam group whose beams all have their rows; snapshots of the groups that finished."""
        groups = {
            self._beam_owner[s]: None
            for c in scheduled.scheduled
            for s in c.sample_ids
            if s in self._beam_owner
        }
        outputs: list[RequestOutput] = []
        for group in groups:
            if not group.ready:
                continue
            for seq_id in group.beams:
                del self._beam_owner[seq_id]
            if group.advance(self.scheduler):
                del self._beam_groups[group.request_id]
                outputs.append(group.snapshot(self.tokenizer))
            else:
                self._beam_owner.update(dict.fromkeys(group.beams, group))
        return outputs

    def _update(
        self, scheduled: SchedulerOutput, sampled: list[tuple[str, int, TokenLogprobs | None]]
    ) -> list[RequestOutput]:
        """Record the sampled tokens (finding stop strings), apply the scheduler's stop rules, snapshot."""
        now = time.monotonic()
        held: list[str] = []
        for chunk in scheduled.scheduled:
            group = self._beam_owner.get(chunk.request_id)
            if group is not None:
                if group.first_scheduled_time is None:
                    group.first_scheduled_time = now
                self.counters.count_chunk(chunk, len(group.prompt_token_ids))
                held.extend(chunk.sample_ids)
                continue
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
        self.counters.generation_tokens += len(sampled) + len(held)
        tokens = {seq_id: [token] for seq_id, token, _ in sampled}
        for request in self.scheduler.update_from_output(scheduled, tokens, stopped, held):
            state = self._seq_owner[request.request_id]
            state.finish_as_scheduled(request, stopped.get(request.request_id))
            progressed[state.request_id] = state
        outputs = [state.snapshot() for state in progressed.values()]
        if held:
            outputs += self._advance_beams(scheduled, now)
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
            num_host_blocks=self.num_host_kv_blocks,
            enable_prefix_caching=self.config.scheduler_config.enable_prefix_caching,
        )
