"""POST /v1/completions: one engine request per prompt, n samples each, streamed or whole."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from pagoda.server.api.beam_fields import BEAM_FIELDS, with_beam_search
from pagoda.server.api.cache_scope import request_scope
from pagoda.server.api.errors import APIError, bad_request
from pagoda.server.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from pagoda.server.api.serving_base import (
    EventStreamResponse,
    ServingContext,
    final_outputs,
    merge_streams,
    prompt_logprobs_field,
    sse,
    to_api_error,
    top_entries,
    until_disconnect,
)
from pagoda.server.api.unserved import check_fields
from pagoda.server.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

Prompt = tuple[str | None, list[int]]


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs],
    k: int,
    offset: int,
    into: CompletionLogprobs | None = None,
    *,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The legacy logprobs object of some generated tokens (appended to `into` if given); text offsets start at
    `offset`. `as_ids` (return_tokens_as_token_ids) names each token `token_id:<id>` (offsets stay the text's)."""
    result = CompletionLogprobs() if into is None else into
    for token_id, position in zip(token_ids, positions, strict=False):
        sampled = position.get(token_id)
        text = sampled.decoded_token if sampled is not None else ""
        result.tokens.append(token_label(token_id, text, as_ids))
        result.token_logprobs.append(sampled.logprob if sampled is not None else None)
        result.top_logprobs.append(
            {token_label(i, t, as_ids): lp for i, lp, t in top_entries(position, k)} if k else None
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result


def token_label(token_id: int, text: str, as_ids: bool) -> str:
    """How logprobs name a generated token: its text, or vLLM's `token_id:<id>` (which tells apart tokens whose
    text is the same or is part of a UTF-8 character)."""
    return f"token_id:{token_id}" if as_ids else text


@dataclass(frozen=True, slots=True)
class _Echo:
    """What `echo` puts before a choice's text: the prompt, and with logprobs, the prompt tokens' logprobs."""

    text: str
    first_token_text: str  # the first prompt token's text: it has no logprobs (null), but it is listed
    prompt_token_ids: Sequence[int]

    def logprobs(self, output: RequestOutput, k: int) -> CompletionLogprobs:
        """The prompt part of `logprobs.token_logprobs` (lm-evaluation-harness reads it): null, then one per
        prompt token, from the request's prompt logprobs."""
        result = CompletionLogprobs(
            text_offset=[0], token_logprobs=[None], tokens=[self.first_token_text], top_logprobs=[None]
        )
        positions = [p for p in (output.prompt_logprobs or ())[1:] if p is not None]
        return completion_logprobs(
            self.prompt_token_ids[1:], positions, k, len(self.first_token_text), into=result
        )


NO_ECHO = _Echo("", "", ())


def _visible(output: CompletionOutput, echo_only: bool) -> CompletionOutput:
    """The choice as the client sees it: echo with max_tokens 0 ran one step for the prompt logprobs and shows
    no generated token (vLLM's behaviour)."""
    if not echo_only:
        return output
    return dataclasses.replace(output, text="", token_ids=(), logprobs=(), cumulative_logprob=None)


@dataclass(slots=True)
class _ChoiceCursor:
    """How much of one choice a stream has sent."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    done: bool = False
    started: bool = False


class CompletionsHandler:
    """Validates a completion request, runs it on the engine and formats the response."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def _prompts(self, body: CompletionRequest) -> list[Prompt]:
        raw = body.prompt
        if isinstance(raw, str):
            items: list[str | list[int]] = [raw]
        elif not raw:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(raw[0], int):
            items = [[int(t) for t in raw if isinstance(t, int)]]
        else:
            items = [p for p in raw if isinstance(p, str | list)]
        # Before any tokenizing: the fan-out caps, then the length bound of each text.
        self.ctx.check_fan_out(len(items), body.n, body.best_of)
        texts = [item for item in items if isinstance(item, str)]
        for text in texts:
            if not text:
                raise bad_request("prompt must not be empty", "prompt")
            self.ctx.check_prompt_chars(text, "prompt")
        encoded = iter(await self.ctx.encode(texts, add_special_tokens=body.add_special_tokens))
        return [(item, next(encoded)) if isinstance(item, str) else (None, item) for item in items]

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        """Serve one completion request."""
        ctx = self.ctx
        check_fields(body, served=BEAM_FIELDS)
        ctx.check_model(body.model)
        if body.stream and body.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not available with stream", "prompt_logprobs")
        # echo with max_tokens 0 (lm-evaluation-harness's loglikelihood requests): score the prompt, generate
        # nothing visible. The engine runs one step, as vLLM does.
        echo_only = body.echo and body.max_tokens == 0
        prompts = await self._prompts(body)
        requested = 1 if echo_only else body.max_tokens
        max_tokens = min(ctx.rules.max_tokens(ids, requested, "prompt") for _, ids in prompts)
        echo_logprobs = body.echo and body.logprobs is not None
        prompt_logprobs = body.prompt_logprobs
        if echo_logprobs:
            prompt_logprobs = max(body.logprobs or 0, prompt_logprobs or 0)
        params = with_beam_search(
            body,
            ctx.sampling_params(
                body, max_tokens=max_tokens, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs
            ),
        )
        ctx.check_prompt_logprobs(
            [len(ids) for _, ids in prompts],
            params.prompt_logprobs,
            "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs",
        )
        params = await ctx.with_bad_words(await ctx.with_structured_outputs(body, params))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        echoes = [
            await self._echo(text, ids, echo_logprobs) if body.echo else NO_ECHO for text, ids in prompts
        ]
        streams = await ctx.open_streams(request_id, prompts, params, cache_scope=request_scope(request))
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._stream(
                request_id, body, prompts, echoes, merge_streams(streams), include_usage, echo_only
            )
            return EventStreamResponse(events)
        try:
            finals = await until_disconnect(request, final_outputs(streams))
        finally:
            for stream in streams:
                stream.close()
        finals = [self._visible_final(final, echo_only) for final in finals]
        choices = [
            self._choice(p * params.n + o.index, o, final, echoes[p], body)
            for p, final in enumerate(finals)
            for o in final.outputs
        ]
        response = CompletionResponse(
            id=request_id,
            model=ctx.response_model(body.model),
            choices=choices,
            usage=_usage(prompts, finals),
        )
        return JSONResponse(response.model_dump())

    async def _echo(self, text: str | None, ids: Sequence[int], with_logprobs: bool) -> _Echo:
        """The echo of one prompt (decoded when the prompt came as token ids)."""
        echo_text = text if text is not None else await self.ctx.decode(ids)
        first = await self.ctx.decode(ids[:1]) if with_logprobs else ""
        return _Echo(echo_text, first, ids if with_logprobs else ())

    @staticmethod
    def _visible_final(final: RequestOutput, echo_only: bool) -> RequestOutput:
        if not echo_only:
            return final
        return dataclasses.replace(final, outputs=tuple(_visible(o, echo_only) for o in final.outputs))

    @staticmethod
    def _logprobs(
        output: CompletionOutput,
        final: RequestOutput,
        echo: _Echo,
        k: int | None,
        offset: int,
        as_ids: bool = False,
    ) -> CompletionLogprobs | None:
        """The choice's legacy logprobs: the prompt's first when echoed, then the generated tokens'."""
        if k is None:
            return None
        head = echo.logprobs(final, k) if echo.prompt_token_ids else None
        start = offset if head is None else sum(len(t) for t in head.tokens)
        return completion_logprobs(
            output.token_ids, output.logprobs or (), k, start, into=head, as_ids=as_ids
        )

    def _choice(
        self, index: int, output: CompletionOutput, final: RequestOutput, echo: _Echo, body: CompletionRequest
    ) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=echo.text + output.text,
            logprobs=self._logprobs(
                output, final, echo, body.logprobs, len(echo.text), body.return_tokens_as_token_ids
            ),
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            prompt_logprobs=prompt_logprobs_field(final.prompt_logprobs)
            if body.prompt_logprobs is not None
            else None,
        )

    async def _stream(
        self,
        request_id: str,
        body: CompletionRequest,
        prompts: list[Prompt],
        echoes: list[_Echo],
        snapshots: AsyncGenerator[tuple[int, RequestOutput]],
        include_usage: bool,
        echo_only: bool,
    ) -> AsyncGenerator[str]:
        continuous_usage = body.stream_options is not None and body.stream_options.continuous_usage_stats
        model = self.ctx.response_model(body.model)
        n = body.n
        cursors = [_ChoiceCursor() for _ in range(len(prompts) * n)]
        finals: dict[int, RequestOutput] = {}
        async with aclosing(snapshots):
            try:
                async for p, raw in snapshots:
                    snapshot = self._visible_final(raw, echo_only)
                    if snapshot.finished:
                        finals[p] = snapshot
                    for output in snapshot.outputs:
                        index = p * n + output.index
                        choice = self._delta(
                            cursors[index],
                            index,
                            output,
                            snapshot,
                            echoes[p],
                            body.logprobs,
                            body.return_tokens_as_token_ids,
                        )
                        if choice is not None:
                            chunk = CompletionResponse(id=request_id, model=model, choices=[choice])
                            if include_usage and continuous_usage:  # this prompt's usage so far
                                chunk.usage = _usage([prompts[p]], [snapshot])
                            yield sse(chunk)
            except Exception as exc:
                error = to_api_error(exc)
                if not isinstance(error, APIError):
                    error = APIError(500, "internal error while generating")
                yield sse(error.to_model())
                yield sse("[DONE]")
                return
        if include_usage:
            ordered = [finals[p] for p in sorted(finals)]
            usage = _usage(prompts, ordered)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
        yield sse("[DONE]")

    def _delta(
        self,
        cursor: _ChoiceCursor,
        index: int,
        output: CompletionOutput,
        snapshot: RequestOutput,
        echo: _Echo,
        logprobs: int | None,
        as_ids: bool = False,
    ) -> CompletionChoice | None:
        if cursor.done:
            return None
        prefix = "" if cursor.started else echo.text
        # The first chunk carries the echo, and with logprobs the prompt's logprobs (complete by then: a request
        # first shows up once its prompt is computed).
        head = None
        if not cursor.started:
            cursor.started = True
            cursor.text_offset = len(echo.text)
            if logprobs is not None and echo.prompt_token_ids:
                head = echo.logprobs(snapshot, logprobs)
                cursor.text_offset = sum(len(t) for t in head.tokens)
        text = output.text[cursor.text_len :]
        new_ids = output.token_ids[cursor.num_tokens :]
        # Tokens that add no text yet (a partial UTF-8 character) go out with the next text, unless the client
        # asked for their logprobs.
        if not (prefix or text or output.finished or (new_ids and logprobs is not None)):
            return None
        lp = None
        if logprobs is not None:
            positions = (output.logprobs or ())[cursor.num_tokens :]
            num_head = len(head.tokens) if head is not None else 0
            lp = completion_logprobs(
                new_ids, positions, logprobs, cursor.text_offset, into=head, as_ids=as_ids
            )
            cursor.text_offset += sum(len(t) for t in lp.tokens[num_head:])
        cursor.text_len = len(output.text)
        cursor.num_tokens = len(output.token_ids)
        cursor.done = output.finished
        return CompletionChoice(
            index=index,
            text=prefix + text,
            logprobs=lp,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )


def _usage(prompts: Sequence[Prompt], finals: Sequence[RequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    completion_tokens = sum(len(o.token_ids) for final in finals for o in final.outputs)
    cached = sum(final.num_cached_tokens for final in finals)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
