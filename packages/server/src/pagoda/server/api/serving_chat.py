"""POST /v1/chat/completions: messages rendered with the chat template, n samples, streamed or whole."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from pagoda.server.api.cache_scope import request_scope
from pagoda.server.api.chat_prompt import chat_prompt
from pagoda.server.api.errors import APIError, bad_request
from pagoda.server.api.legacy_functions import map_legacy_functions
from pagoda.server.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from pagoda.server.api.reasoning import ReasoningParser, ReasoningStream
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
from pagoda.server.api.serving_completions import token_label
from pagoda.server.api.serving_tools import ToolPlan, check_tool_messages, plan_tools
from pagoda.server.api.tool_fields import DeltaToolCall
from pagoda.server.api.tool_parsers import ToolCallStream
from pagoda.server.api.unserved import check_fields
from pagoda.server.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], k: int, *, as_ids: bool = False
) -> ChatLogprobs:
    """The chat logprobs object of some generated tokens with k alternatives each (`as_ids`: tokens named
    `token_id:<id>`, return_tokens_as_token_ids; `bytes` stay the text's)."""
    content: list[TokenLogprob] = []
    for token_id, position in zip(token_ids, positions, strict=False):
        sampled = position.get(token_id)
        text = sampled.decoded_token if sampled is not None else ""
        content.append(
            TokenLogprob(
                token=token_label(token_id, text, as_ids),
                logprob=sampled.logprob if sampled is not None else float("-inf"),
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=token_label(i, t, as_ids), logprob=lp, bytes=list(t.encode()))
                    for i, lp, t in top_entries(position, k)
                ],
            )
        )
    return ChatLogprobs(content=content)


def assistant_message(text: str, parser: ReasoningParser | None, tools: ToolPlan) -> AssistantMessage:
    """A choice's whole message: its text, or with a reasoning parser its reasoning and content (None if empty,
    as vLLM sends them); the tool plan's parser splits the calls off the content."""
    reasoning: str | None = None
    content: str | None = text
    if parser is not None:
        reasoning_text, content_text = parser.split(text)
        reasoning, content = reasoning_text or None, content_text or None
    if content is None:
        return AssistantMessage(content=None, reasoning_content=reasoning)
    content, calls = tools.split(content)
    return AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls)


@dataclass(slots=True)
class _Cursor:
    """How much of one choice the stream has sent."""

    text_len: int = 0
    num_tokens: int = 0
    done: bool = False
    reasoning: ReasoningStream | None = None  # with --reasoning-parser
    tools: ToolCallStream | None = None  # with tool calls to parse
    content: str = ""  # the content so far, which the tool parser reads (with --reasoning-parser)


class ChatHandler:
    """Validates a chat request, runs it on the engine and formats the response."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        """Serve one chat completion request."""
        ctx = self.ctx
        check_fields(
            body, served=("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
        )
        legacy = map_legacy_functions(body)
        check_tool_messages(body.messages)
        if body.echo:
            raise bad_request("echo is not supported yet on chat completions", "echo")
        ctx.check_model(body.model)
        if body.stream and body.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not available with stream", "prompt_logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        ctx.check_fan_out(1, body.n, body.best_of)
        plan = await legacy.named_errors(
            ctx.run(lambda: plan_tools(legacy.body, ctx.tool_parser, compact_json=ctx.compact_json))
        )
        rendered = await chat_prompt(
            ctx,
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            template_kwargs=body.chat_template_kwargs,
            tools=plan.tools,
        )
        prompt, prompt_ids = rendered.text, rendered.token_ids
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = ctx.rules.max_tokens(prompt_ids, requested, "messages")
        top_k = (body.top_logprobs or 0) if body.logprobs else None
        params = ctx.sampling_params(body, max_tokens=max_tokens, logprobs=top_k)
        ctx.check_prompt_logprobs([len(prompt_ids)], params.prompt_logprobs, "prompt_logprobs")
        params = plan.adjust(await ctx.with_bad_words(await ctx.with_structured_outputs(body, params)))
        if plan.constraint is not None:  # the schema of a required or named tool_choice
            await ctx.check_grammar(plan.constraint, {plan.constraint.kind: "tools"})
        # Output forced to a schema holds no reasoning block to split off.
        reasoning_parser = ctx.reasoning_parser if plan.constraint is None else None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await ctx.open_streams(
            request_id,
            [(prompt, prompt_ids)],
            params,
            cache_scope=request_scope(request),
            multi_modal=rendered.multi_modal,
        )
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._stream(
                request_id,
                body,
                len(prompt_ids),
                merge_streams(streams),
                top_k,
                include_usage,
                _Choices(reasoning_parser, plan),
            )
            return EventStreamResponse(events)
        try:
            (final,) = await until_disconnect(request, final_outputs(streams))
        finally:
            for stream in streams:
                stream.close()
        choices: list[ChatChoice] = []
        for o in final.outputs:
            message = assistant_message(o.text, reasoning_parser, plan)
            choices.append(
                ChatChoice(
                    index=o.index,
                    message=message,
                    logprobs=None
                    if top_k is None
                    else chat_logprobs(
                        o.token_ids, o.logprobs or (), top_k, as_ids=body.return_tokens_as_token_ids
                    ),
                    finish_reason=plan.finish_reason(o.finish_reason, called=bool(message.tool_calls)),
                    stop_reason=o.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id,
            model=ctx.response_model(body.model),
            choices=choices,
            usage=_usage(len(prompt_ids), final),
            prompt_logprobs=prompt_logprobs_field(final.prompt_logprobs),
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        num_prompt_tokens: int,
        snapshots: AsyncGenerator[tuple[int, RequestOutput]],
        top_k: int | None,
        include_usage: bool,
        choices: _Choices,
    ) -> AsyncGenerator[str]:
        model = self.ctx.response_model(body.model)
        cursors = [choices.cursor() for _ in range(body.n)]
        final: RequestOutput | None = None
        continuous = (
            include_usage and body.stream_options is not None and body.stream_options.continuous_usage_stats
        )
        as_ids = body.return_tokens_as_token_ids
        latest: RequestOutput | None = None  # with continuous_usage_stats: every chunk's usage so far

        def chunk(choice: ChatStreamChoice) -> str:
            usage = None if latest is None else _usage(num_prompt_tokens, latest)
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice], usage=usage))

        # The first event of every choice carries the role, as OpenAI sends it.
        for i in range(body.n):
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async with aclosing(snapshots):
            try:
                async for _, snapshot in snapshots:
                    if snapshot.finished:
                        final = snapshot
                    if continuous:
                        latest = snapshot
                    for output in snapshot.outputs:
                        for choice in _deltas(
                            cursors[output.index], output, top_k, choices.plan, as_ids=as_ids
                        ):
                            yield chunk(choice)
            except Exception as exc:
                error = to_api_error(exc)
                if not isinstance(error, APIError):
                    error = APIError(500, "internal error while generating")
                yield sse(error.to_model())
                yield sse("[DONE]")
                return
        if include_usage and final is not None:
            usage = _usage(num_prompt_tokens, final)
            yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage))
        yield sse("[DONE]")


@dataclass(frozen=True, slots=True)
class _Choices:
    """How every streamed choice of a request splits its text: the reasoning parser and the tool plan."""

    reasoning: ReasoningParser | None
    plan: ToolPlan

    def cursor(self) -> _Cursor:
        """A new choice's cursor, with its own parser states."""
        reasoning = None if self.reasoning is None else ReasoningStream(self.reasoning)
        return _Cursor(reasoning=reasoning, tools=self.plan.stream())


def _deltas(
    cursor: _Cursor, output: CompletionOutput, top_k: int | None, plan: ToolPlan, *, as_ids: bool = False
) -> list[ChatStreamChoice]:
    """The delta of one snapshot (content, reasoning, tool calls), then the finish chunk (an empty delta) once it
    is done."""
    if cursor.done:
        return []
    choices: list[ChatStreamChoice] = []
    new_ids = output.token_ids[cursor.num_tokens :]
    reasoning, content = "", output.text[cursor.text_len :]
    if cursor.reasoning is not None:
        # A tail that may still become a tag waits: `content` is what the parser settled, not what arrived.
        reasoning, content = cursor.reasoning.delta(output.text, finished=output.finished)
    calls: list[DeltaToolCall] = []
    if cursor.tools is not None:
        cursor.content += content
        content, calls = cursor.tools.delta(cursor.content, finished=output.finished)
    # Tokens that add nothing yet (a partial UTF-8 character, a tail that may become a tag) wait for the next
    # delta, unless their logprobs were asked for.
    if reasoning or content or calls or (new_ids and top_k is not None):
        delta = DeltaMessage(content=content)
        if cursor.reasoning is not None or cursor.tools is not None:
            if reasoning and (content or calls):
                # Snapshots a slow reader missed arrive merged (async_llm's OutputBox): the end of the think
                # block goes out first, alone, so that no delta mixes the two phases.
                choices.append(
                    ChatStreamChoice(index=output.index, delta=DeltaMessage(reasoning_content=reasoning))
                )
                reasoning = ""
            delta = DeltaMessage(
                content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None
            )
        logprobs = None
        if top_k is not None:
            positions = (output.logprobs or ())[cursor.num_tokens :]
            logprobs = chat_logprobs(new_ids, positions, top_k, as_ids=as_ids)
        choices.append(ChatStreamChoice(index=output.index, delta=delta, logprobs=logprobs))
        cursor.num_tokens = len(output.token_ids)
    cursor.text_len = len(output.text)
    if output.finished:
        cursor.done = True
        called = cursor.tools is not None and cursor.tools.called
        choices.append(
            ChatStreamChoice(
                index=output.index,
                delta=DeltaMessage(),
                finish_reason=plan.finish_reason(output.finish_reason, called=called),
                stop_reason=output.stop_reason,
            )
        )
    return choices


def _usage(num_prompt_tokens: int, final: RequestOutput) -> UsageInfo:
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=num_prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=final.num_cached_tokens),
    )
