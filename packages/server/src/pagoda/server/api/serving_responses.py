"""POST /v1/responses (whole, streamed or in the background) and GET / DELETE / cancel of stored responses.

A request is served as the chat request it amounts to (`responses_input.chat_request`): the same chat template,
tool plan, structured-output check, reasoning parser and sampling parameters as /v1/chat/completions.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Any

from pagoda.server.api.cache_scope import request_scope
from pagoda.server.api.chat_prompt import chat_prompt
from pagoda.server.api.errors import APIError, bad_request
from pagoda.server.api.protocol import ChatCompletionRequest
from pagoda.server.api.response_store import ResponseStore, StoredResponse, StoreFull, request_caller
from pagoda.server.api.responses_input import chat_request, input_messages, output_items, output_messages
from pagoda.server.api.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from pagoda.server.api.responses_stream import EventWriter, ItemBuilder
from pagoda.server.api.serving_base import (
    RETRY_AFTER_SECONDS,
    EventStreamResponse,
    ServingContext,
    final_outputs,
    merge_streams,
    to_api_error,
    until_disconnect,
)
from pagoda.server.api.serving_chat import _Choices, _deltas, assistant_message
from pagoda.server.api.serving_tools import PreparedChat, check_tool_messages, plan_tools
from pagoda.server.async_llm import RequestStream
from pagoda.server.outputs import RequestOutput
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send


def _input(message: int, part: int) -> str:
    """The Responses field of every image part."""
    return "input"


class ResponsesHandler:
    """Validates a responses request, runs it as a chat request and keeps what `store` asks for."""

    def __init__(self, ctx: ServingContext, store: ResponseStore) -> None:
        self.ctx = ctx
        self.store = store

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        """Serve one POST /v1/responses."""
        ctx = self.ctx
        ctx.check_model(body.model)
        if body.background and not body.store:
            raise bad_request("background responses must be stored: set store to true", "background")
        if body.background and body.stream:
            raise bad_request("streaming a background response is not supported", "stream")
        if body.background and not self.store.enabled:
            raise bad_request(
                "background responses are off: this server stores none (--max-stored-responses 0)",
                "background",
            )
        if not body.input:
            raise bad_request("input must not be empty", "input")
        caller = request_caller(request)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = self.store.get(caller, body.previous_response_id)
            if previous is None:
                raise APIError(
                    404,
                    f"Previous response with id {body.previous_response_id!r} not found.",
                    param="previous_response_id",
                )
            if previous.task is not None:
                raise bad_request("the previous response is still in progress", "previous_response_id")
            history = previous.conversation
        conversation = history + input_messages(body)
        chat = chat_request(body, conversation)
        check_tool_messages(chat.messages)
        prepared = await self._prepare(body, chat)
        response_id = f"resp_{uuid.uuid4().hex}"
        base = _skeleton(body, response_id, ctx.response_model(body.model))
        entry = self._reserve(body, caller, base, conversation)
        release = functools.partial(self.store.release, caller, response_id)
        try:
            streams = await ctx.open_streams(
                response_id,
                [(prepared.prompt, prepared.prompt_ids)],
                prepared.params,
                cache_scope=request_scope(request),
                multi_modal=prepared.multi_modal,
            )
        except BaseException:
            release()
            raise
        if body.stream:
            return _ReleasingStream(
                self._stream(base, streams, prepared, caller, conversation, entry), release
            )
        if entry is not None and body.background:
            entry.task = asyncio.ensure_future(self._background(entry, caller, base, streams, prepared))
            entry.pending = False  # now seen (queued), and still busy while its task runs
            return JSONResponse(entry.response)
        try:
            try:
                (final,) = await until_disconnect(request, final_outputs(streams))
            finally:
                for stream in streams:
                    stream.close()
            message = assistant_message(final.outputs[0].text, prepared.reasoning, prepared.plan)
            done = await self._finish(base, final, output_items(message), prepared)
            if entry is not None:
                self.store.put(
                    caller, response_id, StoredResponse(done, conversation + output_messages(done["output"]))
                )
        finally:
            release()  # a no-op once stored
        return JSONResponse(done)

    async def retrieve(self, response_id: str, request: Request) -> Response:
        """GET /v1/responses/{id}: the caller's stored response."""
        return JSONResponse(self._stored(response_id, request).response)

    async def delete(self, response_id: str, request: Request) -> Response:
        """DELETE /v1/responses/{id}: forget it (a background one still running is cancelled)."""
        self._stored(response_id, request)
        entry = self.store.delete(request_caller(request), response_id)
        if entry is not None and entry.task is not None:
            entry.task.cancel()
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, response_id: str, request: Request) -> Response:
        """POST /v1/responses/{id}/cancel: stop a background response still running; it ends `cancelled`."""
        entry = self._stored(response_id, request)
        task = entry.task
        if task is None:
            if entry.response.get("status") == "cancelled":
                return JSONResponse(entry.response)
            raise bad_request(
                f"only a background response still in progress can be cancelled; {response_id!r} is "
                f"{entry.response.get('status')}",
                "response_id",
            )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return JSONResponse(entry.response)

    def _stored(self, response_id: str, request: Request) -> StoredResponse:
        entry = self.store.get(request_caller(request), response_id)
        if entry is None:  # another key's response is not found either: its ids are not even confirmed
            raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id")
        return entry

    def _reserve(
        self,
        body: ResponsesRequest,
        caller: str | None,
        base: ResponseObject,
        conversation: list[dict[str, Any]],
    ) -> StoredResponse | None:
        """Hold the stored response's place in the caller's quota before it starts (None: not stored).

        A quota full of the caller's own responses still in progress is a 429 (retry once one ends: OpenAI's
        status for a quota that frees up, and the one its clients retry), naming `background` or `store`; one that
        could never fit is a 400. Nothing running, and nothing of another key's, is dropped to make room.
        """
        if not (body.store and self.store.enabled):
            return None
        entry = StoredResponse(_with(base, status="queued").model_dump(), conversation, pending=True)
        param = "background" if body.background else "store"
        try:
            self.store.reserve(caller, base.id, entry)
        except StoreFull as exc:
            hint = "" if body.background else "; or set store to false"
            if exc.transient:
                headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
                raise APIError(429, f"{exc}{hint}", param=param, headers=headers) from exc
            raise bad_request(f"{exc}{hint}", param) from exc
        return entry

    async def _prepare(self, body: ResponsesRequest, chat: ChatCompletionRequest) -> PreparedChat:
        """The chat handler's checks and parameters, with the errors naming the Responses fields."""
        ctx = self.ctx
        plan = await ctx.run(lambda: plan_tools(chat, ctx.tool_parser, compact_json=ctx.compact_json))
        # Image parts are named as `input` (a Responses item's messages may merge or lead with instructions).
        rendered = await chat_prompt(
            ctx,
            chat.messages,
            add_generation_prompt=True,
            tools=plan.tools,
            param="input",
            image_param=_input,
        )
        prompt, prompt_ids = rendered.text, rendered.token_ids
        max_tokens = ctx.rules.max_tokens(prompt_ids, body.max_output_tokens, "input")
        params = ctx.sampling_params(chat, max_tokens=max_tokens, logprobs=None)
        try:
            params = await ctx.with_structured_outputs(chat, params)
        except APIError as exc:
            if exc.param is not None and exc.param.startswith("response_format"):
                raise bad_request(exc.message.replace("response_format", "text.format"), "text") from exc
            raise
        params = plan.adjust(params)
        if plan.constraint is not None:  # the schema of a required or named tool_choice
            await ctx.check_grammar(plan.constraint, {plan.constraint.kind: "tools"})
        # Output forced to a schema holds no reasoning block to split off.
        reasoning = ctx.reasoning_parser if plan.constraint is None else None
        return PreparedChat(prompt, prompt_ids, params, plan, reasoning, rendered.multi_modal)

    async def _finish(
        self,
        base: ResponseObject,
        final: RequestOutput,
        items: list[dict[str, Any]],
        prepared: PreparedChat,
    ) -> dict[str, Any]:
        """The finished response object: its output, status and usage."""
        output = final.outputs[0]
        reasoning_text = "".join(
            part["text"] for item in items if item["type"] == "reasoning" for part in item["content"]
        )
        reasoning_tokens = 0
        if reasoning_text:  # the parser splits text, not tokens: count the reasoning's tokens back
            (ids,) = await self.ctx.encode([reasoning_text], add_special_tokens=False)
            reasoning_tokens = min(len(ids), len(output.token_ids))
        num_input, num_output = len(prepared.prompt_ids), len(output.token_ids)
        usage = ResponseUsage(
            input_tokens=num_input,
            input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
            output_tokens=num_output,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=num_input + num_output,
        )
        status: Any = "completed"
        incomplete = None
        error = None
        if output.finish_reason == "length":
            status, incomplete = "incomplete", IncompleteDetails(reason="max_output_tokens")
        elif output.finish_reason == "abort":
            status, error = "failed", {"code": "server_error", "message": "the request was aborted"}
        done = _with(base, status=status, output=items, usage=usage)
        done.incomplete_details, done.error = incomplete, error
        return done.model_dump()

    async def _background(
        self,
        entry: StoredResponse,
        caller: str | None,
        base: ResponseObject,
        streams: Sequence[RequestStream],
        prepared: PreparedChat,
    ) -> None:
        """Run a background response to its end, updating its stored entry (cancelled: `cancelled`)."""
        entry.response = _with(base, status="in_progress").model_dump()
        conversation = entry.conversation
        try:
            (final,) = await final_outputs(streams)
            message = assistant_message(final.outputs[0].text, prepared.reasoning, prepared.plan)
            done = await self._finish(base, final, output_items(message), prepared)
            entry.response, entry.conversation = done, conversation + output_messages(done["output"])
        except asyncio.CancelledError:
            entry.response = _with(base, status="cancelled").model_dump()
            raise
        except Exception as exc:
            error = to_api_error(exc)
            message_text = error.message if isinstance(error, APIError) else "internal error while generating"
            failed = _with(base, status="failed")
            failed.error = {"code": "server_error", "message": message_text}
            entry.response = failed.model_dump()
        finally:
            entry.task = None
            self.store.settle(caller, base.id)  # counted at its final size; the caller's quota restored
            for stream in streams:
                stream.close()

    async def _stream(
        self,
        base: ResponseObject,
        streams: Sequence[RequestStream],
        prepared: PreparedChat,
        caller: str | None,
        conversation: list[dict[str, Any]],
        entry: StoredResponse | None,
    ) -> AsyncGenerator[str]:
        """The official event sequence: created, in_progress, each item's added / deltas / done, completed."""
        writer = EventWriter()
        started = base.model_dump()
        yield writer.emit("response.created", response=started)
        yield writer.emit("response.in_progress", response=started)
        builder = ItemBuilder(writer)
        cursor = _Choices(prepared.reasoning, prepared.plan).cursor()
        final: RequestOutput | None = None
        snapshots = merge_streams(streams)
        async with aclosing(snapshots):
            try:
                async for _, snapshot in snapshots:
                    if snapshot.finished:
                        final = snapshot
                    for output in snapshot.outputs:
                        for choice in _deltas(cursor, output, None, prepared.plan):
                            for event in builder.feed(choice.delta):
                                yield event
            except Exception as exc:
                error = to_api_error(exc)
                if not isinstance(error, APIError):
                    error = APIError(500, "internal error while generating")
                yield writer.emit("error", code=str(error.status), message=error.message, param=error.param)
                return
        for event in builder.close():
            yield event
        if final is None:  # a stream always ends with a finished snapshot or an error
            yield writer.emit("error", code="500", message="the engine returned no output", param=None)
            return
        done = await self._finish(base, final, builder.items, prepared)
        if entry is not None:
            turns = conversation + output_messages(done["output"])
            self.store.put(caller, done["id"], StoredResponse(done, turns))
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        yield writer.emit(kind.get(done["status"], "response.failed"), response=done)


class _ReleasingStream(EventStreamResponse):
    """The event stream of a response to be stored: its held place is given back however the stream ends (a
    generator never started, when the client left at once, runs no `finally` of its own)."""

    def __init__(self, events: AsyncGenerator[str], release: Callable[[], None]) -> None:
        super().__init__(events)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the stream, then release the place (a no-op once stored)."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _with(base: ResponseObject, **changes: Any) -> ResponseObject:
    """A copy of a response object with some fields changed."""
    return base.model_copy(update=changes)


def _skeleton(body: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    """The response object before any output: the request's settings echoed, status in_progress."""
    fmt: dict[str, Any] = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True)
    tool_choice: Any = body.tool_choice
    if tool_choice is None:
        tool_choice = "auto" if body.tools else "none"
    elif not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    return ResponseObject(
        id=response_id,
        model=model,
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        metadata=body.metadata,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        tool_choice=tool_choice,
        tools=[dict(tool) for tool in body.tools or ()],
        text={"format": fmt},
        store=body.store,
        background=body.background,
        user=body.user,
    )
