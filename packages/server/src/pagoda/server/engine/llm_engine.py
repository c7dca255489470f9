"""The engine: one step is schedule -> execute -> sample -> update, plus the bookkeeping around it.

Two seams keep features out of `step()`:

- **The request contract** (`pagoda.server.request_contract`). Every user request is an `EngineRequest`, and
  takes its rows through one capability, resolved once when the engine registers it (`RequestOwners`): the
  sampler draws them (`SamplesTokens`: plain requests; speculative ones, whose rows cover their draft
  positions and whose `end_step` proposes the next drafts) or they are handed over as float32 log-probabilities
  (`TakesLogprobRows`: beam search, pooling). Prompt logprobs and hidden states are optional capabilities too.
- **The engine extensions** (`extension.EngineExtension`): per-engine features in a list that `step()` loops
  over at fixed points: the gates at admission (`GrammarGate` while a grammar compiles, `EngineLoRA` while an
  adapter is read), before execution, after the update (`speculation.Drafting`), and at a request's end.

A new per-request feature is a request type or capability; a new per-engine feature is an extension; a new
scheduling rule is a scheduler policy or admission rule (the LoRA cap is `pagoda.scheduler.AdapterCap`).
None of them is a branch in `step()`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    AdaptivePolicy,
    EncoderSpan,
    KVBlockManager,
    Scheduler,
    SchedulerOutput,
    apply_profile,
)
from pagoda.server.client_stream import EngineSleepingError
from pagoda.server.config import EngineConfig, resolved_scheduler_config
from pagoda.server.engine.admission import AdmissionRules, RequestRejectedError, check_resume
from pagoda.server.engine.counters import TokenCounters
from pagoda.server.engine.draft_setup import load_draft
from pagoda.server.engine.executor import Executor, UniProcExecutor, build_executor
from pagoda.server.engine.extension import EngineExtension
from pagoda.server.engine.grammar_gate import GrammarGate
from pagoda.server.engine.images import ImageEncoder, encoder_spans
from pagoda.server.engine.lora_extension import EngineLoRA, NoLoRA
from pagoda.server.engine.owners import RequestOwners
from pagoda.server.engine.preemption_costs import measure_preemption_costs
from pagoda.server.engine.prompt_logprobs import add_prompt_logprobs, prompt_lens
from pagoda.server.engine.request_factory import NewRequest, new_request
from pagoda.server.engine.scheduling import build_kv_manager, kv_cache_groups
from pagoda.server.engine.setup import EngineConfigError, EngineParts
from pagoda.server.engine.sleep import EngineSleep, SleepModeError, check_level, check_tags
from pagoda.server.engine.sleep_setup import engine_sleep
from pagoda.server.engine.speculation import Drafting, speculation_for
from pagoda.server.engine.step_sampler import SampledStep, StepSampler
from pagoda.server.engine.step_timing import StepTimer, probed_step_model
from pagoda.server.handoff import Resume
from pagoda.server.kv_events import start_kv_events
from pagoda.server.kv_events.keys import KVEventsKeys
from pagoda.server.kv_events.wire import HOST_TIER_MEDIUM
from pagoda.server.kv_tiers.offload import TieredOffload
from pagoda.server.kv_tiers.peer import KVTransferSpec
from pagoda.server.kv_tiers.setup import kv_tiers_for
from pagoda.server.lora import LoRAError, LoRARequest
from pagoda.server.lora.build import max_loras
from pagoda.server.lora.peft_loader import LoRAAdapter
from pagoda.server.models.vision import VisionLanguageModel
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.outputs import EngineStats, RequestOutput
from pagoda.server.pooling import SupportedTask
from pagoda.server.pooling.checks import Matryoshka, PoolingRules
from pagoda.server.pooling.classifier import ScoreHead
from pagoda.server.request_contract import EngineRequest
from pagoda.server.sampling import Sampler, unseeded_seed
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.startup import log_phase
from pagoda.server.structured import GrammarBitmask, StructuredOutputManager
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# How long an empty step waits when requests are held back by the policy (static batching's timeout).
_IDLE_WAIT_S = 0.001
# How long an empty step waits for a held request (a grammar, an adapter) before returning to the caller's loop.
_HOLD_POLL_S = 0.01


class LLMEngine:
    """Continuous-batching engine over a paged KV cache; drive it with add_request / step."""

    def __init__(
        self,
        config: EngineConfig,
        parts: EngineParts,
        executor: Executor | None = None,
        *,
        kv_events_keys: KVEventsKeys | None = None,
        kv_transfer: KVTransferSpec | None = None,
    ) -> None:
        self.config = config
        self.tokenizer: PreTrainedTokenizerBase = parts.tokenizer
        self.model_name = parts.model_name
        self.model_path: Path = parts.model_path
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.vocab_size
        # The model side: the whole model here, or tensor-parallel ranks whose rank 0 runs here (`executor.driver`).
        self.executor = executor or UniProcExecutor(parts.runner())
        self.runner = self.executor.driver
        self.num_kv_blocks = self.executor.num_blocks
        self.num_host_kv_blocks = self.executor.num_host_blocks
        self.block_size = config.cache_config.block_size
        self.device = parts.device
        self.dtype = parts.dtype
        self.eos_token_ids = parts.eos_token_ids
        model_config = config.model_config
        self.rules = AdmissionRules(parts.max_model_len, parts.vocab_size, model_config.max_input_tokens)
        # generate or pooling: which requests this engine serves, and how the pooling runner pools (and scores,
        # with a sequence-classification model's head).
        classifier = self.runner.model.classifier() if model_config.runner == "pooling" else None
        self.pooling_rules = PoolingRules(
            model_config.runner,
            model_config.pooler_config,
            Matryoshka.of_model(parts.model_path),
            None if classifier is None else ScoreHead.of_model(parts.model_path, classifier),
        )
        groups = kv_cache_groups(parts.kv_cache.shape)
        self._kv_shape = parts.kv_cache.shape
        self.kv_manager: KVBlockManager = build_kv_manager(
            config,
            self.num_kv_blocks,
            self.num_host_kv_blocks,
            parts.max_model_len,
            groups=groups,
        )
        # The scheduler section itself, with the limits only the loaded model could tell.
        scheduler_config = resolved_scheduler_config(
            config.scheduler_config,
            max_model_len=parts.max_model_len,
            max_num_batched_tokens=parts.max_num_batched_tokens,
            kv_manager=config.cache_config.kv_manager,
        )
        # A scheduling profile's knobs, scaled to this pool (it never turns on prefix caching the allocator lacks).
        scheduler_config = apply_profile(scheduler_config, self.num_kv_blocks, self.block_size)
        # LoRA: the per-step adapter cap is the scheduler's admission rule (vLLM's default 1); None without LoRA.
        scheduler_config = dataclasses.replace(scheduler_config, max_loras=max_loras(config))
        # A vision-language model: its image encoder and cache (an extension, fed to the runner), whose budget
        # is the scheduler's admission rule (vLLM's default encoder cache size: a step's tokens).
        # (An executor without a driver rank, as the engine's tests use, has no model here.)
        model = getattr(self.runner, "model", None)
        self.images: ImageEncoder | None = None
        if isinstance(model, VisionLanguageModel):
            if config.parallel_config.tensor_parallel_size > 1:
                raise EngineConfigError(
                    "vision-language models run with tensor_parallel_size 1 only (for now)"
                )
            self.images = ImageEncoder(model, parts.device)
            self.runner.images = self.images
            scheduler_config = dataclasses.replace(
                scheduler_config, encoder_cache_tokens=scheduler_config.max_num_batched_tokens
            )
        costs = None
        if scheduler_config.preemption_mode == "auto":
            costs = measure_preemption_costs(self.executor, parts.max_num_batched_tokens, parts.max_model_len)
        self.scheduler = Scheduler(scheduler_config, self.kv_manager, preemption_costs=costs)
        structured = config.structured_outputs_config
        # The op's backend follows the engine's kernel backend (cpu -> C, triton / cupy -> Triton, torch -> torch).
        sampler = Sampler(parts.backend.name, parts.device)
        # method draft_model: the draft model, its own runner and paged KV (None otherwise).
        self.draft = (
            load_draft(config, parts, scheduler_config.max_num_seqs, sampler.probabilities)
            if self.scheduler.supports_drafts
            else None
        )
        self.step_sampler = StepSampler(
            sampler,
            GrammarBitmask(self.vocab_size, self.eos_token_ids, structured.grammar_fill_timeout),
            # sampled drafts are verified against the draft's q
            draft_probs=None if self.draft is None else self.draft.drafter.draft_probs,
        )
        self._unseeded_requests = 0  # numbers the unseeded requests, whose RNG seeds derive from config.seed
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids, structured.grammar_cache_bytes
        )
        self.speculate = speculation_for(config, self.scheduler, self.executor, self.draft)  # None: no drafts
        # The adaptive policy's step-time model starts from this machine's costs, measured now.
        if isinstance(self.scheduler.policy, AdaptivePolicy):
            self.scheduler.policy.model = probed_step_model(self.scheduler, self.executor)
        self.owners = RequestOwners()  # unfinished user requests, by id, by sequence, by capability
        # Final snapshots of aborted requests, returned by the next step.
        self._aborted: list[RequestOutput] = []
        self.counters = TokenCounters()
        self.last_schedule: SchedulerOutput | None = None  # the latest step's chunks (live views read them)
        # The extensions, in admission order: an adapter is read before a grammar compiles (as the request's
        # adapter pins first), then the scheduler gets the request.
        self.lora: EngineLoRA | None = None if parts.lora is None else EngineLoRA.build(config, parts.lora)
        self.gate = GrammarGate(self.structured)  # constrained requests whose grammar is compiling
        # Drafting counts whatever drafts were verified (a request may be made speculative after start-up).
        drafting = Drafting(self.counters, None if self.draft is None else self.draft.drafter)
        self.extensions: list[EngineExtension] = [self.lora or NoLoRA(), self.gate, drafting]
        if self.scheduler.wants_step_timing:  # the adaptive policy's cost model, the SLO tracker
            self.extensions.append(StepTimer())
        if self.images is not None:
            self.extensions.append(self.images)
        # KV tiers: blocks beyond the pool come back from host memory or disk (an extension and the allocator's
        # tier index; pagoda.server.kv_tiers).
        self.kv_tiers = kv_tiers_for(
            config, self.executor, self.draft, self.kv_manager, parts.model_path, kv_transfer
        )
        if self.kv_tiers is not None:
            self.extensions.append(self.kv_tiers)
        self.kv_events = start_kv_events(
            config.cache_config.kv_events_config,
            self.kv_manager,
            medium="GPU" if parts.device.type == "cuda" else "CPU",
            data_parallel_rank=config.parallel_config.data_parallel_rank,
            keys=kv_events_keys,  # an engine core's, from its spec; None: the publisher makes its own
        )
        if self.kv_events is not None and self.kv_tiers is not None:
            # The host tier's stores and evictions go out in the same batches, under the tier's medium.
            self.kv_tiers.publish_events(self.kv_events.medium_sink(HOST_TIER_MEDIUM))
        # Sleep mode: the KV pools and weights of the target (and draft) runner; None without enable_sleep_mode.
        self.sleeping: EngineSleep | None = (
            engine_sleep(config, parts, self.executor, self.draft) if model_config.enable_sleep_mode else None
        )

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        kv_events_keys: KVEventsKeys | None = None,
        kv_transfer: KVTransferSpec | None = None,
    ) -> LLMEngine:
        """Load the model, size the KV cache and build the engine (EngineConfigError if it cannot serve); with
        tensor_parallel_size > 1 the model is split over that many ranks (see `pagoda.server.engine.executor`)."""
        executor, parts = build_executor(config)
        try:
            start = time.perf_counter()
            engine = cls(config, parts, executor, kv_events_keys=kv_events_keys, kv_transfer=kv_transfer)
            log_phase("engine", start)
            return engine
        except BaseException:
            executor.shutdown()
            raise

    @property
    def kv_block_bytes(self) -> int:
        """One block position of a sequence over every layer of every KV group: what moving it between engines
        costs (the KV transfer metrics)."""
        return self._kv_shape.bytes_per_block * len(kv_cache_groups(self._kv_shape))

    @property
    def kv_endpoint(self) -> str | None:
        """Where other engines pull this engine's KV blocks over TCP (None: it serves none)."""
        connector = None if self.kv_tiers is None else self.kv_tiers.connector
        return connector.endpoint if isinstance(connector, TieredOffload) else None

    @property
    def supported_tasks(self) -> tuple[SupportedTask, ...]:
        """What this engine serves (vLLM's name): generate, embed, score."""
        return self.pooling_rules.supported_tasks

    def close(self) -> None:
        """Stop the executor's workers (tensor parallelism); the engine serves no step afterwards."""
        if self.kv_events is not None:
            self.kv_events.close()
        for extension in self.extensions:
            extension.close()
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
        multi_modal: MultiModalInputs | None = None,
        resume: Resume | None = None,
        prompt_param: str = "prompt",
    ) -> None:
        """Queue a request (under `lora_request`'s adapter, if given; with `multi_modal`'s images in its prompt;
        going on from `resume`'s outputs, drawn by another engine); RequestRejectedError (with `param`: the prompt's
        is `prompt_param`) if it can never run."""
        if self.is_sleeping:
            raise EngineSleepingError("the engine is sleeping: wake_up() first")
        ids = tuple(prompt_token_ids)
        # A constraint was parsed by the front end (the API, or LLM): only compiling is left, off the step.
        self.rules.check(ids, params, prompt_param)
        params = self.pooling_rules.admit(params)
        if resume is not None:
            check_resume(params, resume)
        if request_id in self.owners.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use", "request_id")
        spans: tuple[EncoderSpan, ...] = ()
        if multi_modal is not None:
            if self.images is None:
                raise RequestRejectedError(f"the model {self.model_name!r} does not take images", "messages")
            spans = tuple(encoder_spans(multi_modal, len(ids), self.images.model.bidirectional_images))
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
            lora_request or params.lora_request,
            self.speculate,
            self.pooling_rules.score_head,
            multi_modal,
            spans,
            resume,
        )
        try:
            self._pass_on(new, 0)
        except BaseException:
            self._done(request_id)
            raise
        self.owners.own(new.owner, new.request.num_prompt_tokens)

    def _pass_on(self, new: NewRequest, first: int) -> None:
        """Offer `new` to the extensions from index `first` on; the first that holds it keeps it, and a request
        none holds goes to the scheduler (which refuses what can never fit the KV pool or the batch)."""
        for extension in self.extensions[first:]:
            if extension.hold(new):
                return
        self.scheduler.add_request(new.request)

    def _release_held(self) -> None:
        """Pass on the requests the gates released; abort those whose wait failed."""
        for index, extension in enumerate(self.extensions):
            released = extension.release()
            for request_id in released.failed:
                self._abort(self.owners.requests[request_id])
            for new in released.ready:
                try:
                    self._pass_on(new, index + 1)
                except Exception:  # checked at admission: the engine's failure, not the request's
                    logger.exception("request %s could not be admitted", new.request.request_id)
                    self._abort(new.owner)

    def _request_seed(self, params: SamplingParams) -> int:
        """The request's own seed, or the next unseeded request's, derived from the engine's `--seed`."""
        if params.seed is not None:
            return params.seed
        self._unseeded_requests += 1
        return unseeded_seed(self.config.model_config.seed, self._unseeded_requests)

    def abort_request(self, request_id: str) -> None:
        """Abort a request in any state, freeing its KV blocks now; unknown or finished ids are ignored."""
        owner = self.owners.requests.get(request_id)
        if owner is None:
            return
        # A request held at a gate is unknown to the scheduler: its abort there is a no-op.
        self.scheduler.abort_request(request_id)
        self._abort(owner)

    def has_unfinished_requests(self) -> bool:
        """Whether any request still waits, runs, or has an undelivered abort."""
        return bool(self.owners.requests) or bool(self._aborted)

    def get_num_unfinished_requests(self) -> int:
        """User requests not finished yet."""
        return len(self.owners.requests)

    # -------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one engine step; snapshots of the requests that progressed, finished or were aborted."""
        self._release_held()
        outputs, self._aborted = self._aborted, []
        scheduled = self.scheduler.schedule()
        self.last_schedule = scheduled
        if scheduled.is_empty:
            self._idle(bool(outputs))
            return outputs
        rows = self.step_sampler.plan(scheduled, self.owners)  # its masks fill while the model runs
        for extension in self.extensions:
            extension.before_execute(scheduled)
        lens = prompt_lens(scheduled, self.owners)
        # Rows that only need a token may be drawn by the model's fused LM head (None: it did not run the step).
        token_only = self.step_sampler.token_only(rows)
        fused = None if token_only is None else self.executor.execute_sampled(scheduled, lens, token_only)
        if fused is not None:
            drawn, prompt_hidden = fused
            add_prompt_logprobs(self.executor, self.owners, prompt_hidden)
            sampled = self.step_sampler.sampled(rows, drawn)
        else:
            logits, prompt_hidden = self.executor.execute(scheduled, lens)
            add_prompt_logprobs(self.executor, self.owners, prompt_hidden)
            sampled = self.step_sampler.sample(rows, logits)
        sampled.failures.abort_in(self.scheduler)  # their rows get no token: the update skips them
        outputs += self._update(scheduled, sampled)
        for owner in sampled.failures.requests.values():
            self._forget(owner, owner.seq_ids)
            self._done(owner.request_id)
        return outputs + sampled.failures.finish()

    def _idle(self, reported: bool) -> None:
        """Nothing ran: wait for a held request, or yield the core while the policy holds requests back."""
        waited = [extension.wait(_HOLD_POLL_S) for extension in self.extensions]
        if not any(waited) and not reported and self.scheduler.has_unfinished_requests():
            # A static batch still forming: a step loop would spin on this, so yield for a moment.
            time.sleep(_IDLE_WAIT_S)

    def _update(self, scheduled: SchedulerOutput, sampled: SampledStep) -> list[RequestOutput]:
        """Record the rows (finding stop strings), apply the scheduler's stop rules, close the step, snapshot."""
        now = time.monotonic()
        owners = self.owners
        for chunk in scheduled.scheduled:
            owner = owners.seqs[chunk.request_id]
            owner.mark_scheduled(chunk.start, now)
            self.counters.count_chunk(chunk, owners.num_prompt_tokens[owner.request_id])
        progressed: dict[str, EngineRequest] = {}
        stopped: dict[str, str] = {}  # sequence id -> the stop string its new token completed
        tokens: dict[str, list[int]] = {}
        ended: set[str] = set()  # sequences of a run of several tokens that a stop rule ends before its last
        samplers = owners.samplers
        for seq_id, token, logprobs in sampled.drawn:
            if seq_id in ended:
                continue
            drawn = samplers[seq_id]
            stop = drawn.add_token(seq_id, token, logprobs, now)
            run = tokens.setdefault(seq_id, [])
            run.append(token)
            if stop is not None:
                stopped[seq_id] = stop
                ended.add(seq_id)
            elif sampled.has_runs and self.scheduler.tokens_before_stop(seq_id, run) is not None:
                ended.add(seq_id)  # EOS, a stop token or max_tokens inside an accepted run
            progressed[drawn.request_id] = drawn
        for seq_id in sampled.held:
            owner = owners.seqs[seq_id]
            progressed[owner.request_id] = owner
        self.counters.generation_tokens += sum(map(len, tokens.values())) + len(sampled.held)
        for request in self.scheduler.update_from_output(scheduled, tokens, stopped, sampled.held):
            drawn = samplers[request.request_id]  # only drawn sequences get tokens, so only they finish so
            drawn.finish_as_scheduled(request, stopped.get(request.request_id))
            progressed[drawn.request_id] = drawn
        outputs: list[RequestOutput] = []
        for owner in progressed.values():
            seq_ids = owner.seq_ids
            if owner.end_step(self.scheduler):
                outputs.append(owner.snapshot())
            if owner.finished:
                self._forget(owner, seq_ids)
                self._done(owner.request_id)
            elif owner.seq_ids != seq_ids:  # its held sequences were rewritten (forked, pruned)
                owners.reseat(owner, seq_ids)
        for extension in self.extensions:
            extension.after_update(self.scheduler, sampled, now)
        return outputs

    def _abort(self, owner: EngineRequest) -> None:
        """Finish a request as aborted; its final snapshot (if it reports one) goes out with the next step."""
        snapshot = owner.abort()
        if snapshot is not None:
            self._aborted.append(snapshot)
        self._forget(owner, owner.seq_ids)
        self._done(owner.request_id)

    def _forget(self, owner: EngineRequest, seq_ids: Sequence[str]) -> None:
        """Drop a request's bookkeeping under these sequence ids."""
        self.owners.forget(owner, seq_ids)

    def _done(self, request_id: str) -> None:
        """A request has ended (finished, aborted, or refused at admission): every extension drops its part."""
        for extension in self.extensions:
            extension.done(request_id)

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

    # ------------------------------------------------------------------- sleep

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (or a partial wake left part of it asleep)."""
        return self.sleeping is not None and self.sleeping.is_sleeping

    @property
    def enable_sleep_mode(self) -> bool:
        """Whether the engine may sleep (`enable_sleep_mode`)."""
        return self.sleeping is not None

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool and release the weights' memory (level 1 offloads them to host memory on CUDA; level
        2, and level 1 on the CPU, read them back from the checkpoint at wake); SleepModeError naming the field
        when sleep mode is off, a request is unfinished or the level is bad. The prefix cache is reset: nothing
        cached before the sleep is served after the wake."""
        sleeping = self._sleep_side()
        chosen = check_level(level)
        if sleeping.is_sleeping:
            sleeping.sleep(chosen)  # logs that it sleeps already
            return
        if self.has_unfinished_requests():
            raise SleepModeError(
                f"{self.get_num_unfinished_requests()} request(s) are unfinished: the engine sleeps once idle",
                "level",
            )
        # The pool's contents are lost: its hashes go first (and KV cache events say AllBlocksCleared).
        if isinstance(self.kv_manager, BlockManager) and not self.kv_manager.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: KV blocks are still in use")
        self.last_schedule = None
        sleeping.sleep(chosen)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what `tags` name ("weights", "kv_cache"; None: both): the weights come back (from host memory or
        the checkpoint), the KV pool is allocated again; SleepModeError naming the field (`tags`, or `model` when
        sleep mode is off). Waking an awake engine does nothing."""
        self._sleep_side().wake_up(check_tags(tags))

    def _sleep_side(self) -> EngineSleep:
        """The sleep state, or SleepModeError when sleep mode is off."""
        if self.sleeping is None:
            raise SleepModeError("sleep mode is off: enable_sleep_mode (--enable-sleep-mode)", "model")
        return self.sleeping

    # ------------------------------------------------------------------- stats

    def get_stats(self) -> EngineStats:
        """Gauges and counters for /metrics."""
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting + sum(extension.num_held() for extension in self.extensions),
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
            kv_tiers=() if self.kv_tiers is None else self.kv_tiers.connector.stats(),
            token_budget=s.token_budget,
            chunk_size=s.chunk_size,
            max_num_seqs=s.seats,
            slo_attainment=s.slo_attainment,
            slo_sacrificed=s.slo_sacrificed,
        )
