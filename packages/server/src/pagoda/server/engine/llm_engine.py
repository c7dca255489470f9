"""The engine: one step is schedule -> execute -> sample -> update, plus the bookkeeping around it.

The contract of a per-request feature. Every user request is an `EngineRequest` (`engine_request.py`): the engine
keeps one owner map (scheduler sequence id -> its EngineRequest) beside the by-request-id map, and drives every
request through the same calls each step: the rows it needs (`draw_spec`: drawn by the sampler, or handed over as
float32 log-probabilities), what it got (`add_token` / `add_logprob_row`), finishing as the scheduler says, closing
the step (`end_step`), its snapshot and its abort. Plain sampling is `RequestState`, beam search `BeamGroup`; a
request whose grammar is compiling waits at `structured.GrammarGate`, an admission gate in front of the scheduler.
`step()` does not know which features its requests use, and the next ones keep it so: speculative drafts are an
EngineRequest whose rows cover its draft positions and whose `end_step` accepts them; a LoRA adapter is a small
hook on the Protocol that the executor reads per chunk; a pooling request takes hidden states (as prompt logprobs
do) and finishes after its prefill; a new wait before scheduling is a gate. None of them is a branch in `step()`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

from pagoda.scheduler import (
    KVBlockManager,
    Scheduler,
    SchedulerOutput,
)
from pagoda.server.config import EngineConfig, resolved_scheduler_config
from pagoda.server.engine.admission import AdmissionRules, RequestRejectedError
from pagoda.server.engine.counters import TokenCounters
from pagoda.server.engine.draft_setup import load_draft
from pagoda.server.engine.engine_request import EngineRequest
from pagoda.server.engine.executor import Executor, UniProcExecutor, build_executor
from pagoda.server.engine.model_runner import ModelRunner
from pagoda.server.engine.preemption_costs import measure_preemption_costs
from pagoda.server.engine.prompt_logprobs import add_prompt_logprobs, prompt_lens
from pagoda.server.engine.request_factory import new_request
from pagoda.server.engine.scheduling import build_kv_manager, kv_cache_groups
from pagoda.server.engine.setup import EngineParts
from pagoda.server.engine.speculation import AcceptanceLog, speculation_for
from pagoda.server.engine.step_sampler import SampledStep, StepSampler
from pagoda.server.kv_events import start_kv_events
from pagoda.server.lora import LoRAError, LoRARequest
from pagoda.server.lora.engine_lora import DEFAULT_MAX_LORAS, EngineLoRA, build_engine_lora
from pagoda.server.lora.peft_loader import LoRAAdapter
from pagoda.server.outputs import EngineStats, RequestOutput
from pagoda.server.pooling.checks import Matryoshka, PoolingRules
from pagoda.server.sampling import Sampler, unseeded_seed
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.structured import GrammarBitmask, GrammarGate, StructuredOutputManager
from transformers import PreTrainedTokenizerBase

# How long an empty step waits when requests are held back by the policy (static batching's timeout).
_IDLE_WAIT_S = 0.001


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
        # generate or pooling: which requests this engine serves, and how the pooling runner pools.
        self.pooling_rules = PoolingRules(
            model_config.runner, model_config.pooler_config, Matryoshka.of_model(parts.model_path)
        )
        self.kv_manager: KVBlockManager = build_kv_manager(
            config,
            self.num_kv_blocks,
            self.num_host_kv_blocks,
            parts.max_model_len,
            groups=kv_cache_groups(parts.kv_cache.shape),
        )
        # The scheduler section itself, with the limits only the loaded model could tell.
        scheduler_config = resolved_scheduler_config(
            config.scheduler_config,
            max_model_len=parts.max_model_len,
            max_num_batched_tokens=parts.max_num_batched_tokens,
            kv_manager=config.cache_config.kv_manager,
        )
        # LoRA: the per-step adapter cap is the scheduler's (vLLM's default 1); None without LoRA.
        self.lora: EngineLoRA | None = build_engine_lora(config, parts.model, parts.dtype, parts.device)
        if self.lora is not None:  # the runner's own default is None (a test's fake executor has no runner)
            self.runner.lora = self.lora.manager
        max_loras = scheduler_config.max_loras or DEFAULT_MAX_LORAS if self.lora is not None else None
        scheduler_config = dataclasses.replace(scheduler_config, max_loras=max_loras)
        costs = None
        if scheduler_config.preemption_mode == "auto":
            costs = measure_preemption_costs(self.executor, parts.max_num_batched_tokens, parts.max_model_len)
        self.scheduler = Scheduler(scheduler_config, self.kv_manager, preemption_costs=costs)
        structured = config.structured_outputs_config
        # The op's backend follows the engine's kernel backend (cpu -> C, triton / cupy -> Triton, torch -> torch).
        self.step_sampler = StepSampler(
            Sampler(parts.backend.name, parts.device),
            GrammarBitmask(self.vocab_size, self.eos_token_ids, structured.grammar_fill_timeout),
        )
        self._unseeded_requests = 0  # numbers the unseeded requests, whose RNG seeds derive from config.seed
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids, structured.grammar_cache_bytes
        )
        self.gate = GrammarGate()  # the admission gate: constrained requests whose grammar is compiling
        # method draft_model: the draft model, its own runner and paged KV (None otherwise).
        self.draft = (
            load_draft(config, parts, scheduler_config.max_num_seqs, self.step_sampler.sampler.probabilities)
            if self.scheduler.supports_drafts
            else None
        )
        self.speculate = speculation_for(config, self.scheduler, self.executor, self.draft)  # None: no drafts
        if self.draft is not None:  # sampled drafts are verified against the draft's q
            self.step_sampler.draft_probs = self.draft.drafter.draft_probs
        self._requests: dict[str, EngineRequest] = {}  # unfinished user requests by id
        self._seq_owner: dict[str, EngineRequest] = {}  # scheduler sequence id -> its user request
        # Final snapshots of aborted requests, returned by the next step.
        self._aborted: list[RequestOutput] = []
        self.counters = TokenCounters()
        self.last_schedule: SchedulerOutput | None = None  # the latest step's chunks (live views read them)
        self.kv_events = start_kv_events(
            config.cache_config.kv_events_config,
            self.kv_manager,
            medium="GPU" if parts.device.type == "cuda" else "CPU",
            data_parallel_rank=config.parallel_config.data_parallel_rank,
        )
        self.spec_log = AcceptanceLog()

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
        if self.kv_events is not None:
            self.kv_events.close()
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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (under `lora_request`'s adapter, if given); RequestRejectedError (with `param`) if it
        can never run."""
        ids = tuple(prompt_token_ids)
        lora_request = lora_request or params.lora_request
        if lora_request is not None and self.lora is None:
            raise RequestRejectedError("LoRA adapters are served with enable_lora (--enable-lora)", "model")
        # A constraint was parsed by the front end (the API, or LLM): only compiling is left, off the step.
        self.rules.check(ids, params)
        params = self.pooling_rules.admit(params)
        if request_id in self._requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use", "request_id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        new = new_request(
            request_id,
            prompt,
            ids,
            params,
            arrival,
            self.tokenizer,
            self.eos_token_ids,
            self._request_seed,
            lora_request,
            self.speculate,
        )

        def forward() -> None:
            if new.grammar is None:
                # The scheduler refuses what can never fit the KV pool or the batch, naming the field.
                self.scheduler.add_request(new.request)
            else:
                constraint, start = new.grammar
                self.gate.hold(new.request, self.structured.compile(constraint), start)

        if lora_request is None or self.lora is None:
            forward()
        else:  # an adapter not loaded yet is read off this thread; the request waits for it
            try:
                self.lora.admit(request_id, lora_request, forward)
            except BaseException:
                self.lora.finish(request_id)
                raise
        self._own(new.owner)

    def _request_seed(self, params: SamplingParams) -> int:
        """The request's own seed, or the next unseeded request's, derived from the engine's `--seed`."""
        if params.seed is not None:
            return params.seed
        self._unseeded_requests += 1
        return unseeded_seed(self.config.model_config.seed, self._unseeded_requests)

    def abort_request(self, request_id: str) -> None:
        """Abort a request in any state, freeing its KV blocks now; unknown or finished ids are ignored."""
        owner = self._requests.get(request_id)
        if owner is None:
            return
        # A request held at the gate is unknown to the scheduler: its abort there is a no-op.
        self.gate.cancel(request_id)
        if self.lora is not None:
            self.lora.cancel(request_id)
        self.scheduler.abort_request(request_id)
        self._abort(owner)

    def has_unfinished_requests(self) -> bool:
        """Whether any request still waits, runs, or has an undelivered abort."""
        return bool(self._requests) or bool(self._aborted)

    def get_num_unfinished_requests(self) -> int:
        """User requests not finished yet."""
        return len(self._requests)

    # -------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one engine step; snapshots of the requests that progressed, finished or were aborted."""
        for request_id in self.gate.admit_ready(self.scheduler):
            self._abort(self._requests[request_id])
        for request_id in self.lora.admit_ready() if self.lora is not None else ():
            self._abort(self._requests[request_id])
        outputs, self._aborted = self._aborted, []
        scheduled = self.scheduler.schedule()
        self.last_schedule = scheduled
        if scheduled.is_empty:
            self._idle(bool(outputs))
            return outputs
        rows = self.step_sampler.plan(scheduled, self._seq_owner)  # its masks fill while the model runs
        logits, prompt_hidden = self.executor.execute(scheduled, prompt_lens(scheduled, self._seq_owner))
        add_prompt_logprobs(self.executor, self._seq_owner, prompt_hidden)
        sampled = self.step_sampler.sample(rows, logits)
        sampled.failures.abort_in(self.scheduler)  # their rows get no token: the update skips them
        outputs += self._update(scheduled, sampled)
        for owner in sampled.failures.requests.values():
            self._forget(owner, owner.seq_ids)
        return outputs + sampled.failures.finish()

    def _idle(self, reported: bool) -> None:
        """Nothing ran: wait for a held grammar, or yield the core while the policy holds requests back."""
        lora_wait = self.lora is not None and self.lora.wait()
        if (
            not self.gate.wait()
            and not lora_wait
            and not reported
            and self.scheduler.has_unfinished_requests()
        ):
            # A static batch still forming: a step loop would spin on this, so yield for a moment.
            time.sleep(_IDLE_WAIT_S)

    def _update(self, scheduled: SchedulerOutput, sampled: SampledStep) -> list[RequestOutput]:
        """Record the rows (finding stop strings), apply the scheduler's stop rules, close the step, snapshot."""
        now = time.monotonic()
        for chunk in scheduled.scheduled:
            owner = self._seq_owner[chunk.request_id]
            owner.mark_scheduled(chunk.start, now)
            self.counters.count_chunk(chunk, len(owner.prompt_token_ids))
        progressed: dict[str, EngineRequest] = {}
        stopped: dict[str, str] = {}  # sequence id -> the stop string its new token completed
        tokens: dict[str, list[int]] = {}
        ended: set[str] = set()  # a drafted run's sequences that a stop rule ends before its last token
        for seq_id, token, logprobs in sampled.drawn:
            if seq_id in ended:
                continue
            owner = self._seq_owner[seq_id]
            stop = owner.add_token(seq_id, token, logprobs, now)
            run = tokens.setdefault(seq_id, [])
            run.append(token)
            if stop is not None:
                stopped[seq_id] = stop
                ended.add(seq_id)
            elif sampled.verified and self.scheduler.tokens_before_stop(seq_id, run) is not None:
                ended.add(seq_id)  # EOS, a stop token or max_tokens inside an accepted run
            progressed[owner.request_id] = owner
        for seq_id in sampled.held:
            owner = self._seq_owner[seq_id]
            progressed[owner.request_id] = owner
        self.counters.generation_tokens += sum(map(len, tokens.values())) + len(sampled.held)
        if sampled.verified:
            self.counters.count_drafts(sampled.verified)
            self.spec_log.observe(self.counters, now)
        for request in self.scheduler.update_from_output(scheduled, tokens, stopped, sampled.held):
            owner = self._seq_owner[request.request_id]
            owner.finish_as_scheduled(request, stopped.get(request.request_id))
            progressed[owner.request_id] = owner
        outputs: list[RequestOutput] = []
        for owner in progressed.values():
            seq_ids = owner.seq_ids
            if owner.end_step(self.scheduler):
                outputs.append(owner.snapshot())
            if owner.finished:
                self._forget(owner, seq_ids)
            elif owner.seq_ids != seq_ids:  # its held sequences were rewritten (forked, pruned)
                self._forget(owner, seq_ids)
                self._own(owner)
        if self.draft is not None:  # the queued sequences' drafts, in one batch
            self.draft.drafter.draft(self.scheduler)
        return outputs

    def _own(self, owner: EngineRequest) -> None:
        """Register a request and its current sequences."""
        self._requests[owner.request_id] = owner
        self._seq_owner.update(dict.fromkeys(owner.seq_ids, owner))

    def _abort(self, owner: EngineRequest) -> None:
        """Finish a request as aborted; its final snapshot (if it reports one) goes out with the next step."""
        snapshot = owner.abort()
        if snapshot is not None:
            self._aborted.append(snapshot)
        self._forget(owner, owner.seq_ids)

    def _forget(self, owner: EngineRequest, seq_ids: Sequence[str]) -> None:
        """Drop a request's bookkeeping under these sequence ids."""
        self._requests.pop(owner.request_id, None)
        if self.lora is not None and owner.finished:
            self.lora.finish(owner.request_id)
        for seq_id in seq_ids:
            self._seq_owner.pop(seq_id, None)

    # -------------------------------------------------------------------- LoRA

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and serve an adapter now, on this thread (LoRAError naming the field); the server reads it on
        a worker thread instead (`load_lora` then `add_loaded_lora`)."""
        self.add_loaded_lora(self.load_lora(lora_request))

    def load_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter's folder without registering it (safe on any thread)."""
        lora = self._lora_side()
        lora.check_new(lora_request)
        return lora.manager.load(lora_request)

    def add_loaded_lora(self, adapter: LoRAAdapter) -> None:
        """Serve an adapter `load_lora` read (LoRAError if its name or id was taken meanwhile)."""
        self._lora_side().add(adapter)

    def remove_lora(self, lora_name: str) -> LoRARequest:
        """Stop serving an adapter; requests already running on it finish on it."""
        return self._lora_side().remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters served, in load order (empty without LoRA)."""
        return [] if self.lora is None else list(self.lora.served.values())

    def _lora_side(self) -> EngineLoRA:
        """The LoRA side, or LoRAError when the engine serves none."""
        if self.lora is None:
            raise LoRAError("LoRA adapters are served with enable_lora (--enable-lora)", "model")
        return self.lora

    # ------------------------------------------------------------------- stats

    def get_stats(self) -> EngineStats:
        """Gauges and counters for /metrics."""
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting + len(self.gate) + (len(self.lora) if self.lora is not None else 0),
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
            kv_cache_usage_per_group=s.kv_usage_per_group,
            spec_decode_num_drafts=self.counters.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=self.counters.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=self.counters.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(
                self.counters.spec_decode_num_accepted_tokens_per_pos
            ),
        )
