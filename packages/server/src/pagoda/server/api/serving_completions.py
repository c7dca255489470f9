"""POST /v1/completions: one engine request per prompt, n samples each, streamed or whole."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

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
    sse,
    to_api_error,
    top_entries,
    until_disconnect,
)
from pagoda.server.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

Prompt = tuple[str | None, list[int]]


def completion_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], k: int, offset: int
) -> CompletionLogprobs:
    """The legacy logprobs object of some generated tokens; text offsets start at `offset`."""
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        sampled = position.get(token_id)
        text = sampled.decoded_token if sampled is not None else ""
        result.tokens.append(text)
        result.token_logprobs.append(sampled.logprob if sampled is not None else None)
        result.top_logprobs.append({t: lp for _, lp, t in top_entries(position, k)} if k else None)
        result.text_offset.append(offset)
        offset += len(text)
    return result


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
        self.ctx.check_fan_out(len(items), body.n)
        texts = [item for item in items if isinstance(item, str)]
        for text in texts:
            if not text:
                raise bad_request("prompt must not be empty", "prompt")
            self.ctx.check_prompt_chars(text, "prompt")
        encoded = iter(await self.ctx.encode(texts, add_special_tokens=True))
        return [(item, next(encoded)) if isinstance(item, str) else (None, item) for item in items]

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        """Serve one completion request."""
        ctx = self.ctx
        ctx.check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (no prompt logprobs)", "echo")
        prompts = await self._prompts(body)
        max_tokens = min(ctx.rules.max_tokens(ids, body.max_tokens, "prompt") for _, ids in prompts)
        params = ctx.sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs)
        params = await ctx.with_structured_outputs(body, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        echoes = [
            (text if text is not None else await ctx.decode(ids)) if body.echo else ""
            for text, ids in prompts
        ]
        streams = await ctx.open_streams(request_id, prompts, params)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._stream(request_id, body, prompts, echoes, merge_streams(streams), include_usage)
            return EventStreamResponse(events)
        try:
            finals = await until_disconnect(request, final_outputs(streams))
        finally:
            for stream in streams:
                stream.close()
        choices = [
            self._choice(p * params.n + o.index, o, echoes[p], body.logprobs)
            for p, final in enumerate(finals)
            for o in final.outputs
        ]
        response = CompletionResponse(
            id=request_id, model=ctx.served_model_name, choices=choices, usage=_usage(prompts, finals)
        )
        return JSONResponse(response.model_dump())

    def _choice(
        self, index: int, output: CompletionOutput, echo: str, logprobs: int | None
    ) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=echo + output.text,
            logprobs=None
            if logprobs is None
            else completion_logprobs(output.token_ids, output.logprobs or (), logprobs, len(echo)),
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )

    async def _stream(
        self,
        request_id: str,
        body: CompletionRequest,
        prompts: list[Prompt],
        echoes: list[str],
        snapshots: AsyncGenerator[tuple[int, RequestOutput]],
        include_usage: bool,
    ) -> AsyncGenerator[str]:
        model = self.ctx.served_model_name
        n = body.n
        cursors = [_ChoiceCursor() for _ in range(len(prompts) * n)]
        finals: dict[int, RequestOutput] = {}
        async with aclosing(snapshots):
            try:
                async for p, snapshot in snapshots:
                    if snapshot.finished:
                        finals[p] = snapshot
                    for output in snapshot.outputs:
                        index = p * n + output.index
                        choice = self._delta(cursors[index], index, output, echoes[p], body.logprobs)
                        if choice is not None:
                            chunk = CompletionResponse(id=request_id, model=model, choices=[choice])
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
        self, cursor: _ChoiceCursor, index: int, output: CompletionOutput, echo: str, logprobs: int | None
    ) -> CompletionChoice | None:
        if cursor.done:
            return None
        prefix = "" if cursor.started else echo
        if not cursor.started:
            cursor.started = True
            cursor.text_offset = len(echo)
        text = output.text[cursor.text_len :]
        new_ids = output.token_ids[cursor.num_tokens :]
        # Tokens that add no text yet (a partial UTF-8 character) go out with the next text, unless the client
        # asked for their logprobs.
        if not (prefix or text or output.finished or (new_ids and logprobs is not None)):
            return None
        lp = None
        if logprobs is not None:
            positions = (output.logprobs or ())[cursor.num_tokens :]
            lp = completion_logprobs(new_ids, positions, logprobs, cursor.text_offset)
            cursor.text_offset += sum(len(t) for t in lp.tokens)
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
