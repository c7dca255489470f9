"""What the completions and chat handlers share: validation, sampling params, streams, disconnects, SSE."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TypeVar

from pagoda.scheduler import RequestSLO
from pagoda.server.api.cache_scope import combine
from pagoda.server.api.errors import (
    ENGINE_DEAD_MESSAGE,
    ENGINE_RESTARTED_MESSAGE,
    ENGINE_SLEEPING_MESSAGE,
    REPLICA_FAILED_MESSAGE,
    APIError,
    bad_request,
)
from pagoda.server.api.images import ImageFront
from pagoda.server.api.protocol import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    PromptLogprob,
    PromptLogprobsField,
    SamplingFields,
)
from pagoda.server.api.reasoning import ReasoningParser
from pagoda.server.api.serving_structured import GrammarCheck, check_constraint, requested_constraint
from pagoda.server.api.structured_fields import StructuredFields
from pagoda.server.api.tool_parsers import ToolCallParser
from pagoda.server.async_llm import AsyncLLM, PromptRequest, RequestStream
from pagoda.server.client_stream import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineRestartedError,
    EngineSleepingError,
    ReplicaDeadError,
)
from pagoda.server.config import RequestLimits
from pagoda.server.dashboard.tenants import RequestOwners
from pagoda.server.engine.admission import AdmissionRules, RequestRejectedError
from pagoda.server.lora.request import LoRARequest
from pagoda.server.lora.served import ServedLoRAs
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.outputs import PositionLogprobs, RequestOutput
from pagoda.server.sampling.logits_processors import tokenize_bad_words
from pagoda.server.sampling_params import SamplingParams, SamplingParamsError
from pagoda.server.structured import GrammarKind, StructuredOutputsParams
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

T = TypeVar("T")

RETRY_AFTER_SECONDS = 1  # what a 429 tells the client to wait


class ClientDisconnectedError(Exception):
    """The client went away before the response was ready."""


@dataclass(frozen=True, slots=True)
class ServingContext:
    """What every handler needs: the engine front, the API's own tokenizer copy, the model's request rules.

    The rules are the engine's own (`AdmissionRules`); their RequestRejectedError becomes a 400 naming its field.
    Tokenizing and chat-template rendering run on `executor`, never on the event loop: a long prompt takes
    seconds, and the fast tokenizer releases the GIL while it encodes.
    """

    llm: AsyncLLM
    tokenizer: (
        PreTrainedTokenizerBase  # the engine's: encoded and rendered here, decoded by the engine thread
    )
    served_model_name: str
    rules: AdmissionRules
    chat_template: str | None
    executor: Executor
    limits: RequestLimits
    # Longer prompt texts surely exceed max_model_len (None: no sound bound); computed on the tokenizer threads
    # once the server is up (it reads the whole vocabulary: 0.4 s for Gemma 3), so not done for the first moment.
    max_prompt_chars: Future[int | None]
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser (stateless; streams keep their own)
    tool_parser: ToolCallParser | None = None  # --enable-auto-tool-choice --tool-call-parser (stateless)
    grammars: GrammarCheck | None = None  # length, parse and compile-time checks (None: parse only)
    # --[no-]disable-any-whitespace: JSON that a grammar forces (response_format json_schema, required and
    # named tool calls) has no whitespace runs outside strings.
    compact_json: bool = True
    loras: ServedLoRAs | None = None  # the LoRA adapters `model` may name (None: LoRA is off)
    images: ImageFront = field(default_factory=ImageFront)  # the model's image processor and the media policy
    owners: RequestOwners = field(
        default_factory=RequestOwners
    )  # which key submitted each request (dashboard)

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is omitted or names the served model or a served LoRA adapter."""
        self.lora_for(model)

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 when it names neither.

        Asked again when the sampling parameters are built: an adapter unloaded since `check_model` (an await
        apart) is a 404 there, never a silent run on the base model."""
        if model is None or model == self.served_model_name:
            return None
        lora = None if self.loras is None else self.loras.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")
        return lora

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter's name for a request `check_model` let name one (as vLLM
        does; fixed at the request's start, so an adapter unloaded meanwhile is still named), else the base's."""
        return self.served_model_name if model is None else model

    def check_fan_out(self, num_prompts: int, n: int, best_of: int | None = None) -> None:
        """400 when a request has more prompts, or prompts x max(n, best_of) sequences (best_of is a beam search's
        width), than the limits allow; the 400 names best_of when it is the wider."""
        limits = self.limits
        param = "best_of" if best_of is not None and best_of > n else "n"
        width = max(n, best_of or 0)
        if num_prompts > limits.max_prompts_per_request:
            raise bad_request(
                f"the request has {num_prompts} prompts, more than --max-prompts-per-request "
                f"({limits.max_prompts_per_request})",
                "prompt",
            )
        if num_prompts * width > limits.max_sequences_per_request:
            raise bad_request(
                f"the request asks for {num_prompts} prompts x {param} {width} = {num_prompts * width} sequences, "
                f"more than --max-sequences-per-request ({limits.max_sequences_per_request})",
                param,
            )

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Reject, before tokenizing, a prompt text too long to fit max_model_len whatever its tokens."""
        bound = self.max_prompt_chars.result() if self.max_prompt_chars.done() else None
        if bound is not None and len(text) > bound:
            raise RequestRejectedError(
                f"the prompt has {len(text)} characters, so more tokens than max_model_len "
                f"({self.rules.max_model_len})",
                param,
            )

    async def run(self, work: Callable[[], T]) -> T:
        """Run `work` (tokenizing, rendering) on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, work)

    async def encode(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each text, computed off the event loop."""

        def work() -> list[list[int]]:
            return [self.tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]

        return await self.run(work)

    async def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids` (ids must be in the vocabulary), computed off the event loop."""
        text = await self.run(lambda: self.tokenizer.decode(list(token_ids)))
        assert isinstance(text, str)
        return text

    def sampling_params(
        self,
        body: SamplingFields,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams of a request body; a 400 naming the field when a value is out of range (unknown and
        unserved fields are the handlers' check_fields). `prompt_logprobs` defaults to the body's."""
        top_k = body.top_k
        if top_k is not None and (top_k == 0 or top_k < -1):
            raise bad_request("top_k must be -1 (disabled) or at least 1", "top_k")
        stop: tuple[str, ...]
        if body.stop is None:
            stop = ()
        elif isinstance(body.stop, str):
            stop = (body.stop,)
        else:
            stop = tuple(body.stop)
        stop_token_ids = tuple(body.stop_token_ids or ())
        self.rules.check_token_ids(stop_token_ids, "stop_token_ids")
        logit_bias = self._logit_bias(body.logit_bias)
        allowed = None if body.allowed_token_ids is None else tuple(body.allowed_token_ids)
        if allowed is not None and len(allowed) > self.rules.vocab_size:
            raise bad_request(
                f"allowed_token_ids has {len(allowed)} ids, more than the vocabulary's {self.rules.vocab_size}",
                "allowed_token_ids",
            )
        self.rules.check_token_ids(allowed or (), "allowed_token_ids")
        try:
            return SamplingParams(
                n=body.n,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                # -1 disables top-k; beyond the vocabulary it is a no-op, so clamp it there.
                top_k=None if top_k is None or top_k == -1 else min(top_k, self.rules.vocab_size),
                min_p=0.0 if body.min_p is None else body.min_p,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
                frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
                seed=body.seed,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                stop=stop,
                stop_token_ids=stop_token_ids,
                ignore_eos=body.ignore_eos,
                include_stop_str_in_output=body.include_stop_str_in_output,
                logprobs=logprobs,
                skip_special_tokens=body.skip_special_tokens,
                priority=body.priority,
                slo=None if body.slo is None else RequestSLO(body.slo.ttft_ms, body.slo.tpot_ms),
                speculative=body.speculative,
                logit_bias=logit_bias,
                allowed_token_ids=allowed,
                bad_words=None if body.bad_words is None else tuple(body.bad_words),
                prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                cache_salt=body.cache_salt,
                lora_request=self.lora_for(body.model),
            )
        except SamplingParamsError as exc:
            raise bad_request(str(exc), exc.param) from exc

    async def with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """`params` with its bad words tokenized, on the tokenizer threads: the engine thread never tokenizes."""
        words = params.bad_words
        if not words:
            return params
        ids = await self.run(lambda: tokenize_bad_words(self.tokenizer, words))
        return dataclasses.replace(params, bad_words_token_ids=ids)

    def check_prompt_logprobs(self, prompt_lens: Sequence[int], k: int | None, param: str) -> None:
        """400 naming `param` when the prompt logprobs asked for (k alternatives per position of every prompt)
        exceed MAX_PROMPT_LOGPROB_ENTRIES."""
        if k is None:
            return
        entries = sum(prompt_lens) * (k + 1)
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise bad_request(
                f"prompt logprobs of {sum(prompt_lens)} prompt tokens x {k + 1} entries = {entries}, more than "
                f"{MAX_PROMPT_LOGPROB_ENTRIES} per request: ask for fewer alternatives or shorter prompts",
                param,
            )

    async def with_structured_outputs(self, body: StructuredFields, params: SamplingParams) -> SamplingParams:
        """`params` with the body's structured-output constraint, parsed off the event loop (a 400 naming the
        field when it is invalid or when several are given)."""
        requested = requested_constraint(body)
        if requested is None:
            return params
        constraint, fields = requested
        if self.compact_json and fields.get("json") == "response_format.json_schema.schema":
            constraint = dataclasses.replace(constraint, disable_any_whitespace=True)
        await self.check_grammar(constraint, fields)
        return dataclasses.replace(params, structured_outputs=constraint)

    async def check_grammar(
        self, constraint: StructuredOutputsParams, fields: dict[GrammarKind, str]
    ) -> None:
        """A 400 naming the field when the constraint is too long, does not parse or does not compile in time."""
        if self.grammars is None:
            await self.run(lambda: check_constraint(constraint, fields))
        else:
            await self.grammars.check(constraint, fields, self.run)

    def _logit_bias(self, raw: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (JSON keys are strings) keyed by token id; a 400 on `logit_bias` for a key that is
        not a token id of the vocabulary (the value range is SamplingParams' check)."""
        if not raw:
            return None
        bias: dict[int, float] = {}
        for key, value in raw.items():
            text = key.strip()
            if not (text.isascii() and text.lstrip("-").isdigit()) or len(text) > 20:
                raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias")
            bias[int(text)] = value
        self.rules.check_token_ids(list(bias), "logit_bias")
        return bias

    async def open_streams(
        self,
        request_id: str,
        prompts: Sequence[tuple[str | None, Sequence[int]]],
        params: SamplingParams,
        *,
        cache_scope: str | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> list[RequestStream]:
        """Submit the prompts as one admission (one engine request each); map admission failures to HTTP errors.

        All prompts are submitted before any acceptance is awaited, so the engine takes them in one step.
        `cache_scope` (the API key's digest) is folded into the request's cache salt (api/cache_scope.py).
        `multi_modal`: the images of a single prompt (a chat request's).
        """
        if multi_modal is not None and len(prompts) != 1:
            raise ValueError("multi_modal goes with exactly one prompt")
        salt = combine(cache_scope, params.cache_salt)
        if salt != params.cache_salt:
            params = dataclasses.replace(params, cache_salt=salt)
        requests = [
            PromptRequest(request_id if len(prompts) == 1 else f"{request_id}-{i}", ids, text, multi_modal)
            for i, (text, ids) in enumerate(prompts)
        ]
        try:
            streams = await self.llm.add_requests(requests, params)
        except Exception as exc:
            error = to_api_error(exc)
            if error is exc:
                raise
            raise error from exc
        self.owners.add(r.request_id for r in requests)
        return streams


def to_api_error(exc: Exception) -> Exception:
    """The HTTP error of an engine-side failure (other exceptions pass through unchanged)."""
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            429, f"The server is overloaded: {exc}", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
        )
    if isinstance(exc, EngineDrainingError):
        return APIError(503, "The server is shutting down.")
    if isinstance(exc, EngineSleepingError):  # sleep mode without --wake-on-request: retry once it woke
        return APIError(503, ENGINE_SLEEPING_MESSAGE, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    # 503 texts are stable: what failed inside (an exception's text, a core's traceback) is in the server log only.
    if isinstance(exc, EngineRestartedError):  # rebuilt from its config: a retry is served
        return APIError(503, ENGINE_RESTARTED_MESSAGE, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, ReplicaDeadError):  # the other replicas still serve: a retry may succeed
        return APIError(503, REPLICA_FAILED_MESSAGE, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, ENGINE_DEAD_MESSAGE)
    if isinstance(exc, RequestRejectedError):  # the engine names the field at fault
        return bad_request(str(exc), exc.param)
    if isinstance(exc, ValueError):  # SleepModeError, among others, names its field
        return bad_request(str(exc), getattr(exc, "param", None))
    return exc


async def final_output(stream: RequestStream) -> RequestOutput:
    """Consume a stream to its last snapshot."""
    last: RequestOutput | None = None
    try:
        async for output in stream:
            last = output
    except Exception as exc:
        raise to_api_error(exc) from exc
    finally:
        stream.close()
    if last is None:  # a stream always ends with a finished snapshot or an error
        raise APIError(500, "the engine returned no output")
    return last


async def final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The last snapshot of every stream, read concurrently: a stream read only after the others finished would
    look like a stalled reader (--stream-stall-timeout) to the engine thread."""
    if len(streams) == 1:
        return [await final_output(streams[0])]
    tasks = [asyncio.ensure_future(final_output(stream)) for stream in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        return [task.result() for task in tasks]  # the first failure, if any, is raised here
    finally:
        for task in tasks:
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnectedError
    return task.result()


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """Interleave the snapshots of several streams as (stream index, snapshot); closes them all at the end.

    The queue between is bounded, so a consumer that stops reading (a client that does not read its response)
    stops the pumps too, and each stream's `OutputBox` keeps only its latest snapshot meanwhile.
    """
    queue: asyncio.Queue[tuple[int, RequestOutput] | Exception | None] = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: RequestStream) -> None:
        # Nothing is put once cancelled: the consumer has gone, and a put into the full queue would never end.
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as exc:
            await queue.put(exc)
        else:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise to_api_error(item)
            else:
                yield item
    finally:
        # Synchronous on purpose: under a cancelled anyio scope (a client that left) every await raises again,
        # so the aborts must not wait behind one.
        for stream in streams:
            stream.close()
        for task in tasks:
            task.cancel()


class EventStreamResponse(StreamingResponse):
    """A server-sent-event stream that always closes its generator, so that a client who leaves aborts.

    Starlette cancels the sending task on disconnect but leaves the generator suspended at its `yield` until
    garbage collection; closing it here runs its `finally` (the engine aborts) at once.
    """

    def __init__(self, events: AsyncGenerator[str]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the stream, then close the generator whatever happened."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def sse(payload: BaseModel | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def top_entries(position: PositionLogprobs, k: int) -> list[tuple[int, float, str]]:
    """The k most likely alternatives at a position as (token id, logprob, text), by rank."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank)[:k]
    return [(token_id, lp.logprob, lp.decoded_token) for token_id, lp in ranked]


def prompt_logprobs_field(entries: Sequence[PositionLogprobs | None] | None) -> PromptLogprobsField:
    """vLLM's `prompt_logprobs` response field of a request's prompt logprobs."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]
