"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served as the chat request it
translates to (`api/anthropic_input.py`), through the chat path's template, tool plan, structured outputs,
reasoning parser, sampling parameters and stream deltas."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from pagoda.server.api.anthropic_errors import error_event
from pagoda.server.api.anthropic_input import (
    Translated,
    check_unserved_request,
    content_blocks,
    new_message_id,
    stop_reason,
    translate,
)
from pagoda.server.api.anthropic_protocol import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
    Usage,
)
from pagoda.server.api.anthropic_stream import PING, PING_SECONDS, BlockWriter, event, keepalive
from pagoda.server.api.cache_scope import request_scope
from pagoda.server.api.chat_prompt import ChatPrompt, chat_prompt
from pagoda.server.api.errors import APIError, bad_request
from pagoda.server.api.serving_base import (
    EventStreamResponse,
    ServingContext,
    final_outputs,
    merge_streams,
    to_api_error,
    until_disconnect,
)
from pagoda.server.api.serving_chat import _Choices, _deltas, assistant_message
from pagoda.server.api.serving_tools import PreparedChat, ToolPlan, check_tool_messages, plan_tools
from pagoda.server.async_llm import RequestStream
from pagoda.server.outputs import CompletionOutput, RequestOutput
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

ABORTED_MESSAGE = "The server aborted this request before it finished. Retry the request."


def usage(num_prompt_tokens: int, final: RequestOutput, output: CompletionOutput) -> Usage:
    """Anthropic's usage: prompt tokens the prefix cache served are `cache_read_input_tokens`, the rest
    `input_tokens` (their sum is the chat usage's `prompt_tokens`)."""
    cached = min(final.num_cached_tokens, num_prompt_tokens)
    return Usage(
        input_tokens=num_prompt_tokens - cached,
        output_tokens=len(output.token_ids),
        cache_read_input_tokens=cached,
    )


class MessagesHandler:
    """Validates a Messages request, runs it as a chat request and answers in Anthropic's shapes."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        """Serve one POST /v1/messages."""
        ctx = self.ctx
        ctx.check_model(body.model)
        check_unserved_request(body)
        prepared = await self._prepare(translate(body), body.max_tokens)
        message_id = new_message_id()
        model = ctx.response_model(body.model)
        streams = await ctx.open_streams(
            message_id,
            [(prepared.prompt, prepared.prompt_ids)],
            prepared.params,
            cache_scope=request_scope(request),
            multi_modal=prepared.multi_modal,
        )
        if body.stream:
            return EventStreamResponse(self._stream(message_id, model, prepared, streams))
        try:
            (final,) = await until_disconnect(request, final_outputs(streams))
        finally:
            for stream in streams:
                stream.close()
        output = final.outputs[0]
        if output.finish_reason == "abort":
            raise APIError(503, ABORTED_MESSAGE)
        message = assistant_message(output.text, prepared.reasoning, prepared.plan)
        content = content_blocks(message)
        reason, sequence = stop_reason(output, called=bool(message.tool_calls))
        response = MessageResponse(
            id=message_id,
            content=content,
            model=model,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=usage(len(prepared.prompt_ids), final, output),
        )
        return JSONResponse(response.model_dump())

    async def count_tokens(self, body: CountTokensRequest, request: Request) -> Response:
        """Serve one POST /v1/messages/count_tokens: the prompt's tokens, as /v1/messages would count them."""
        self.ctx.check_model(body.model)
        check_unserved_request(body)
        translated = translate(body)
        # The tools are rendered whatever the choice: count them even where this server could not serve it.
        chat = translated.chat.model_copy(update={"tool_choice": "none" if translated.chat.tools else None})
        prompt_ids = await self._prompt_ids(Translated(chat, translated.split_thinking))
        return JSONResponse(TokenCount(input_tokens=len(prompt_ids)).model_dump())

    async def _plan(self, translated: Translated) -> ToolPlan:
        """The chat tool plan, its errors naming Anthropic's fields."""
        ctx = self.ctx
        chat = translated.chat
        check_tool_messages(chat.messages)
        try:
            return await ctx.run(lambda: plan_tools(chat, ctx.tool_parser, compact_json=ctx.compact_json))
        except APIError as exc:
            if exc.param == "tools":
                raise bad_request(
                    exc.message.replace("function.parameters", "input_schema"), "tools"
                ) from exc
            raise

    async def _render(self, translated: Translated, plan: ToolPlan) -> ChatPrompt:
        """The prompt text and ids (rendered and tokenized off the event loop), with its images loaded and
        processed (Anthropic's errors name no field beyond `messages`)."""
        chat = translated.chat
        return await chat_prompt(
            self.ctx,
            chat.messages,
            add_generation_prompt=True,
            template_kwargs=chat.chat_template_kwargs,
            tools=plan.tools,
            image_param=lambda message, part: "messages",
        )

    async def _prompt_ids(self, translated: Translated) -> list[int]:
        """The prompt's token ids alone (count_tokens)."""
        prompt_ids = (await self._render(translated, await self._plan(translated))).token_ids
        self.ctx.rules.check_token_ids(prompt_ids, "messages")
        return prompt_ids

    async def _prepare(self, translated: Translated, max_tokens: int) -> PreparedChat:
        """The chat handler's checks and parameters, with the errors naming Anthropic's fields."""
        ctx = self.ctx
        chat = translated.chat
        plan = await self._plan(translated)
        rendered = await self._render(translated, plan)
        prompt, prompt_ids = rendered.text, rendered.token_ids
        limit = ctx.rules.max_tokens(prompt_ids, max_tokens, "messages")
        params = ctx.sampling_params(chat, max_tokens=limit, logprobs=None)
        params = plan.adjust(await ctx.with_structured_outputs(chat, params))
        if plan.constraint is not None:  # the schema of an `any` or `tool` choice
            await ctx.check_grammar(plan.constraint, {plan.constraint.kind: "tools"})
        # Output forced to a schema holds no thinking block to split off; `thinking: disabled` splits none.
        split = plan.constraint is None and translated.split_thinking
        reasoning = ctx.reasoning_parser if split else None
        return PreparedChat(prompt, prompt_ids, params, plan, reasoning, rendered.multi_modal)

    async def _stream(
        self, message_id: str, model: str, prepared: PreparedChat, streams: Sequence[RequestStream]
    ) -> AsyncGenerator[str]:
        """Anthropic's event sequence: message_start, ping, each block's start / deltas / stop, message_delta
        (stop reason, final usage), message_stop; pings while nothing else is sent; `error` if it fails."""
        try:
            num_prompt = len(prepared.prompt_ids)
            # The prefix cache's share is known once the engine has scheduled the prompt: message_start counts
            # the whole prompt as input, message_delta carries the final split (its counts replace these).
            start = MessageResponse(
                id=message_id, content=[], model=model, usage=Usage(input_tokens=num_prompt, output_tokens=0)
            )
            yield event("message_start", message=start.model_dump())
            yield PING
            writer = BlockWriter()
            cursor = _Choices(prepared.reasoning, prepared.plan).cursor()
            final: RequestOutput | None = None
            snapshots = keepalive(merge_streams(streams), PING_SECONDS)
            async with aclosing(snapshots):
                try:
                    async for item in snapshots:
                        if item is None:
                            yield PING
                            continue
                        _, snapshot = item
                        if snapshot.finished:
                            final = snapshot
                        for output in snapshot.outputs:
                            for choice in _deltas(cursor, output, None, prepared.plan):
                                for text in writer.feed(choice.delta):
                                    yield text
                except Exception as exc:
                    error = to_api_error(exc)
                    yield error_event(
                        error if isinstance(error, APIError) else APIError(500, "internal error")
                    )
                    return
            for text in writer.close():
                yield text
            if final is None:  # a stream always ends with a finished snapshot or an error
                yield error_event(APIError(500, "the engine returned no output"))
                return
            output = final.outputs[0]
            if output.finish_reason == "abort":
                yield error_event(APIError(503, ABORTED_MESSAGE))
                return
            reason, sequence = stop_reason(output, called=writer.called)
            counts = usage(num_prompt, final, output).model_dump()
            yield event(
                "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=counts
            )
            yield event("message_stop")
        finally:
            for stream in streams:  # also when the client left before the first snapshot was read
                stream.close()
