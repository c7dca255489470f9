"""The Starlette app: routes, API-key check, body limits, OpenAI-shaped errors, engine life cycle."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal, TypeVar

from pagoda.server.api.admin import is_admin, set_admin
from pagoda.server.api.anthropic_errors import error_response, is_anthropic_path
from pagoda.server.api.anthropic_protocol import CountTokensRequest, MessagesRequest, ModelPage
from pagoda.server.api.cache_scope import key_digest, set_scope
from pagoda.server.api.chat_prompt import chat_prompt
from pagoda.server.api.errors import APIError, bad_request
from pagoda.server.api.images import ImageFront
from pagoda.server.api.input_checks import first_lone_surrogate, max_prompt_chars
from pagoda.server.api.lora_routes import LoRARoutes, lora_cards
from pagoda.server.api.openapi import build_openapi
from pagoda.server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagoda.server.api.reasoning import make_reasoning_parser
from pagoda.server.api.response_store import ResponseStore, set_caller
from pagoda.server.api.responses_protocol import ResponsesRequest
from pagoda.server.api.score_protocol import RERANK_PATHS, SCORE_PATHS, RerankRequest, ScoreRequest
from pagoda.server.api.serving_base import ClientDisconnectedError, ServingContext, to_api_error
from pagoda.server.api.serving_chat import ChatHandler
from pagoda.server.api.serving_completions import CompletionsHandler
from pagoda.server.api.serving_embeddings import EmbeddingsHandler
from pagoda.server.api.serving_messages import MessagesHandler
from pagoda.server.api.serving_responses import ResponsesHandler
from pagoda.server.api.serving_score import ScoreHandler
from pagoda.server.api.serving_structured import GrammarCheck
from pagoda.server.api.serving_tools import check_tool_messages, template_tools
from pagoda.server.api.sleep_routes import SleepRoutes
from pagoda.server.api.tool_parsers import make_tool_parser
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.chat import resolve_chat_template
from pagoda.server.config import AppSettings, LoRAConfig
from pagoda.server.dashboard.auth import (
    clean_redirect,
    cookie_key,
    is_dashboard_path,
    pop_query_key,
    with_cookie,
)
from pagoda.server.dashboard.producer import FrameProducer
from pagoda.server.dashboard.routes import dashboard_routes
from pagoda.server.dashboard.tenants import CALLER
from pagoda.server.engine import LLMEngine
from pagoda.server.engine.admission import AdmissionRules, RequestRejectedError
from pagoda.server.lora.served import ServedLoRAs
from pagoda.server.structured import StructuredOutputManager
from prometheus_client.core import GaugeMetricFamily, Metric
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
TOKENIZER_THREADS = 4  # threads that tokenize and render chat templates for the API
# Status sent when the client left before its response was ready (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499


class APIKeyMiddleware:
    """401 for every route but /health unless the request carries `Authorization: Bearer <one of the keys>` or
    `x-api-key: <one of the keys>` (Anthropic's header).

    With `isolate`, the matched key's digest is left in the request's state: its requests' prefix-cache salt
    (api/cache_scope.py), so that no key can see, through `cached_tokens`, what another key's prompts cached.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_keys: tuple[str, ...],
        isolate: bool = True,
        admin_keys: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        # (key, digest, admin): an admin key is accepted everywhere a key is, and marked (api/admin.py).
        self._keys = [(key.encode(), key_digest(key.encode()), key in admin_keys) for key in api_keys] + [
            (key.encode(), key_digest(key.encode()), True) for key in admin_keys if key not in api_keys
        ]
        self._isolate = isolate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the bearer token (or x-api-key), then pass the request on."""
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = Headers(scope=scope)
            scheme, _, token = headers.get("authorization", "").partition(" ")
            match = self._match(token.strip().encode()) if scheme.lower() == "bearer" else None
            if is_dashboard_path(
                scope["path"]
            ):  # a browser: the key may come once in the URL, then as a cookie
                await self._dashboard(scope, receive, send, token.strip() if match is not None else None)
                return
            api_key = headers.get("x-api-key")
            if match is None and api_key is not None:  # Anthropic's clients send the key here
                match = self._match(api_key.strip().encode())
            if match is None:
                await _unauthorized(scope, receive, send)
                return
            self._mark(scope, match)
        await self.app(scope, receive, send)

    def _mark(self, scope: Scope, match: tuple[str, bool]) -> None:
        """Leave the key's digest (caller, cache scope) and whether it is an admin key in the request's state."""
        digest, admin = match
        set_caller(scope, digest)  # stored responses are the key's own, whatever the cache sharing
        set_admin(scope, admin)
        CALLER.set(digest)  # the dashboard shows this key its own requests (dashboard/tenants.py)
        if self._isolate:
            set_scope(scope, digest)

    async def _dashboard(self, scope: Scope, receive: Receive, send: Send, bearer: str | None) -> None:
        """`?api_key=` -> cookie + redirect to the clean URL; else the Bearer header or the cookie."""
        query_key = pop_query_key(scope)  # out of the scope before anything (the access log) reads it
        if query_key is not None:
            if self._match(query_key.encode()) is None:
                await _unauthorized(scope, receive, send)
            else:
                await clean_redirect(scope, query_key)(scope, receive, send)
            return
        if bearer is not None:
            match = self._match(bearer.encode())
            assert match is not None  # the caller matched it
            self._mark(scope, match)  # the stream shows this key's own requests (all of them to an admin)
            await self.app(scope, receive, with_cookie(send, bearer))
            return
        cookie = cookie_key(scope)
        match = None if cookie is None else self._match(cookie.encode())
        if match is None:
            await _unauthorized(scope, receive, send)
            return
        self._mark(scope, match)
        await self.app(scope, receive, send)

    def _match(self, token: bytes) -> tuple[str, bool] | None:
        """The digest of the key `token` is and whether it is an admin key, or None; every key is compared
        (compare_digest, no early exit), so the time taken tells neither how much of a key matched nor which."""
        found: tuple[str, bool] | None = None
        for key, digest, admin in self._keys:
            if hmac.compare_digest(token, key):
                found = (digest, admin)
        return found


async def _unauthorized(scope: Scope, receive: Receive, send: Send) -> None:
    """The 401 of a missing or wrong key."""
    error = APIError(401, "Missing or invalid API key.", headers={"WWW-Authenticate": "Bearer"})
    await _error_response(scope["path"], error)(scope, receive, send)


def _error_response(path: str, error: APIError) -> Response:
    """The error's response: Anthropic's shape on the Anthropic routes, OpenAI's elsewhere."""
    return error_response(error) if is_anthropic_path(path) else error.to_response()


# Bodies over this many bytes are parsed and validated on a worker thread: a few MB of JSON takes the parser
# and pydantic tens to hundreds of milliseconds, which would stall every other request on the event loop.
OFF_LOOP_BODY_BYTES = 256 * 1024


async def read_body(request: Request, model: type[M], limit: int, executor: Executor | None = None) -> M:
    """Parse a JSON object body into `model`: 400 for a wrong content type, bad JSON or bad fields, 413 if big.

    A body over OFF_LOOP_BODY_BYTES is parsed on `executor` (None: asyncio's default threads), off the loop.
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise bad_request("Content-Type must be application/json")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The request body is larger than {limit} bytes.")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"The request body is larger than {limit} bytes.")
    except ClientDisconnect as exc:
        raise ClientDisconnectedError from exc
    if len(body) <= OFF_LOOP_BODY_BYTES:
        return parse_body(bytes(body), model)
    return await asyncio.get_running_loop().run_in_executor(executor, parse_body, bytes(body), model)


def parse_body(body: bytes, model: type[M]) -> M:
    """A JSON object body validated into `model`; APIError 400 naming the field at fault."""
    try:
        # Strict UTF-8 (RFC 8259): json.loads of bytes would also take UTF-16 and encoded surrogates.
        data = json.loads(body.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the C parser recurses once per nesting level
        raise bad_request("The body is not valid JSON: it is nested too deeply.") from exc
    if not isinstance(data, dict):
        raise bad_request("The body must be a JSON object.")
    # Only a \uD800-\uDFFF escape can put a lone surrogate into the parsed strings: walk them only then.
    if _SURROGATE_ESCAPE.search(body) is not None:
        path = first_lone_surrogate(data)
        if path is not None:
            where = ".".join(path) or "a key of the body"
            raise bad_request(
                f"{where}: a lone UTF-16 surrogate is not valid text", path[0] if path else None
            )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = [str(part) for part in first["loc"]]
        where = ".".join(loc)
        raise bad_request(
            f"{where}: {first['msg']}" if where else first["msg"], loc[0] if loc else None
        ) from exc


class _GrammarCacheCollector:
    """`<prefix>:grammar_cache_bytes`: what the compiled-grammar cache of the API's manager holds (in-process,
    the engine's own) at scrape time."""

    def __init__(self, manager: StructuredOutputManager, prefix: str, model_name: str) -> None:
        self._manager = manager
        self._prefix = prefix
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        """One gauge."""
        gauge = GaugeMetricFamily(
            f"{self._prefix}:grammar_cache_bytes",
            "Bytes held by the compiled-grammar cache (bounded by --grammar-cache-bytes).",
            labels=["model_name"],
        )
        gauge.add_metric([self._model_name], float(self._manager.cache_size_bytes))
        yield gauge


def _stop_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's eos id, what a front-end grammar check compiles with (only its verdict is used)."""
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else []


def _package_version() -> str:
    try:
        return version("pagoda-server")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0.0.0"


class _Routes:
    """The route handlers, bound to one app's engine and settings."""

    def __init__(
        self,
        llm: AsyncLLM,
        settings: AppSettings,
        lora: LoRAConfig | None = None,
        images: ImageFront | None = None,
    ) -> None:
        engine = llm.engine
        self.loras = None if lora is None or not lora.enable_lora else ServedLoRAs(lora)
        # The engine's own tokenizer, shared: the API's threads only encode and render, the engine thread only
        # decodes, and neither changes its settings (truncation, padding: the Rust tokenizer's only mutations), so
        # concurrent calls never conflict. A deep copy cost 2-4 s of every start for Gemma 3's 262k vocabulary.
        tokenizer = engine.tokenizer
        self.llm = llm
        self.settings = settings
        self.prompt_chars: Future[int | None] = Future()  # ServingContext.max_prompt_chars, computed at start
        # Bounded: a burst of long prompts queues here instead of taking every core from the engine thread.
        self.executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pagoda-tokenizer")
        # The in-process engine's grammar manager: the API's compile fills the cache the engine then reads.
        # Otherwise (engine-core processes, fakes) a front-end one checks the compile, with its own bounded cache.
        self.grammars = (
            engine.structured
            if isinstance(engine, LLMEngine)
            else StructuredOutputManager(tokenizer, engine.vocab_size, _stop_ids(tokenizer))
        )
        self.ctx = ServingContext(
            llm=llm,
            tokenizer=tokenizer,
            served_model_name=llm.served_model_name,
            rules=AdmissionRules(engine.max_model_len, engine.vocab_size),
            chat_template=settings.chat_template or resolve_chat_template(tokenizer),
            executor=self.executor,
            limits=settings.limits,
            max_prompt_chars=self.prompt_chars,
            reasoning_parser=None
            if settings.reasoning_parser is None
            else make_reasoning_parser(settings.reasoning_parser),
            tool_parser=make_tool_parser(settings.tool_call_parser)
            if settings.enable_auto_tool_choice and settings.tool_call_parser is not None
            else None,
            grammars=GrammarCheck(
                self.grammars.compile, settings.max_grammar_chars, settings.grammar_compile_timeout
            ),
            compact_json=settings.disable_any_whitespace,
            loras=self.loras,
            images=images or ImageFront(),
        )
        self.root = engine.model_name
        self.completions_handler = CompletionsHandler(self.ctx)
        self.chat_handler = ChatHandler(self.ctx)
        self.responses_store = ResponseStore(
            settings.max_stored_responses, settings.max_stored_response_bytes
        )
        self.responses_handler = ResponsesHandler(self.ctx, self.responses_store)
        self.embeddings_handler = EmbeddingsHandler(self.ctx)
        self.messages_handler = MessagesHandler(self.ctx)
        self.score_handler = ScoreHandler(self.ctx, engine.supported_tasks)
        self.openapi = build_openapi(
            title="Pagoda OpenAI-compatible API",
            version=_package_version(),
            secured=bool(settings.api_keys() or settings.admin_api_keys()),
        )

    def start_background(self) -> None:
        """Work the first requests need not wait for, on the tokenizer threads once the server is up: the prompt
        text bound (a shortcut that rejects an overlong prompt before tokenizing it; the token count is checked
        after tokenizing anyway)."""
        tokenizer, max_model_len = self.ctx.tokenizer, self.ctx.rules.max_model_len

        def bound() -> None:
            try:
                self.prompt_chars.set_result(max_prompt_chars(tokenizer, max_model_len))
            except Exception:
                logger.exception("no prompt length bound: reading the vocabulary failed")
                self.prompt_chars.set_result(None)

        self.executor.submit(bound)

    async def _body(self, request: Request, model: type[M]) -> M:
        """The request's JSON body as `model` (a large one parsed on the tokenizer threads)."""
        return await read_body(request, model, self.settings.max_body_bytes, self.executor)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        body = await self._body(request, CompletionRequest)
        return await self.completions_handler.create(body, request)

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        body = await self._body(request, ChatCompletionRequest)
        return await self.chat_handler.create(body, request)

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses."""
        body = await self._body(request, ResponsesRequest)
        return await self.responses_handler.create(body, request)

    async def get_response(self, request: Request) -> Response:
        """GET /v1/responses/{response_id}."""
        return await self.responses_handler.retrieve(request.path_params["response_id"], request)

    async def delete_response(self, request: Request) -> Response:
        """DELETE /v1/responses/{response_id}."""
        return await self.responses_handler.delete(request.path_params["response_id"], request)

    async def cancel_response(self, request: Request) -> Response:
        """POST /v1/responses/{response_id}/cancel."""
        return await self.responses_handler.cancel(request.path_params["response_id"], request)

    async def messages(self, request: Request) -> Response:
        """POST /v1/messages (Anthropic's Messages API)."""
        body = await self._body(request, MessagesRequest)
        return await self.messages_handler.create(body, request)

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens."""
        body = await self._body(request, CountTokensRequest)
        return await self.messages_handler.count_tokens(body, request)

    async def embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings (the pooling runner)."""
        body = await self._body(request, EmbeddingRequest)
        return await self.embeddings_handler.create(body, request)

    async def score(self, request: Request) -> Response:
        """POST /score (and /v1/score): the pooling runner's pair scores."""
        body = await self._body(request, ScoreRequest)
        return await self.score_handler.score(body, request)

    async def rerank(self, request: Request) -> Response:
        """POST /rerank (and /v1/rerank, /v2/rerank): documents ranked against a query."""
        body = await self._body(request, RerankRequest)
        return await self.score_handler.rerank(body, request)

    async def models(self, request: Request) -> Response:
        """GET /v1/models (Anthropic's shape to a request with an `anthropic-version` header)."""
        # Folders are the admin's to see: another key gets the served names where the paths would be.
        admin, name = is_admin(request), self.ctx.served_model_name
        card = ModelCard(
            id=name, root=self.root if admin else name, max_model_len=self.ctx.rules.max_model_len
        )
        adapters = lora_cards(self.loras, name, self.ctx.rules.max_model_len, show_paths=admin)
        cards = [card, *adapters]
        if "anthropic-version" in request.headers:  # Anthropic's clients: their page shape
            return JSONResponse(ModelPage.of([(c.id, c.created) for c in cards]).model_dump())
        return JSONResponse(ModelList(data=cards).model_dump())

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: a prompt, or chat messages through the chat template."""
        body = await self._body(request, TokenizeRequest)
        ctx = self.ctx
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            check_tool_messages(body.messages)
            # Image parts count as the tokens the model's processor gives them (their images are loaded).
            rendered = await chat_prompt(
                ctx,
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                tools=template_tools(body.tools),
            )
            tokens = rendered.token_ids
        else:
            ctx.check_prompt_chars(body.prompt or "", "prompt")
            (tokens,) = await ctx.encode([body.prompt or ""], add_special_tokens=body.add_special_tokens)
        max_model_len = ctx.rules.max_model_len
        if len(tokens) > max_model_len:  # the completions' bound, after the tokenizer too
            raise bad_request(
                f"the prompt has {len(tokens)} tokens, more than max_model_len ({max_model_len})",
                "prompt" if body.messages is None else "messages",
            )
        response = TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens)
        return JSONResponse(response.model_dump())

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize."""
        body = await self._body(request, DetokenizeRequest)
        self.ctx.check_model(body.model)
        self.ctx.rules.check_token_ids(body.tokens, "tokens")
        return JSONResponse(DetokenizeResponse(prompt=await self.ctx.decode(body.tokens)).model_dump())

    async def health(self, request: Request) -> Response:
        """GET /health: 200 while the engine loop (and one replica at least) is alive, 503 once it died or
        shutdown began; with engine-core replicas, how many there are and how many serve."""
        counts: dict[str, Any] = {}
        alive = self.llm.is_alive
        if self.llm.replicas is not None:
            status = self.llm.replicas.replica_status()
            counts = {"replicas": len(status), "replicas_alive": sum(r.alive for r in status)}
            if any(r.role is not None for r in status):
                counts["replica_roles"] = [r.role for r in status]
            alive = alive and counts["replicas_alive"] > 0
        if not alive:
            return JSONResponse(
                HealthResponse(status="dead", **counts).model_dump(exclude_none=True), status_code=503
            )
        if self.llm.is_draining:
            return JSONResponse(
                HealthResponse(status="draining", **counts).model_dump(exclude_none=True), status_code=503
            )
        # Asleep is alive (vLLM answers 200 too): a liveness probe must not restart a sleeping server.
        state: Literal["ok", "sleeping"] = "sleeping" if self.llm.is_sleeping else "ok"
        return JSONResponse(HealthResponse(status=state, **counts).model_dump(exclude_none=True))

    async def metrics(self, request: Request) -> Response:
        """GET /metrics: Prometheus text format."""
        return Response(self.llm.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi_json(self, request: Request) -> Response:
        """GET /openapi.json."""
        return JSONResponse(self.openapi)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _error_response(request.url.path, exc)


async def _rejected(request: Request, exc: Exception) -> Response:
    # A request rule a handler checked before the engine saw the request: the same 400 as the engine's.
    error = to_api_error(exc)
    assert isinstance(error, APIError)
    return _error_response(request.url.path, error)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    return _error_response(request.url.path, APIError(exc.status_code, str(exc.detail), headers=headers))


async def _client_left(request: Request, exc: Exception) -> Response:
    # Nobody reads this response; the status only marks the access log.
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # The traceback goes to the server log only; the client gets an OpenAI-shaped 500.
    logger.error("unhandled error on %s", request.url.path, exc_info=exc)
    return _error_response(request.url.path, APIError(500, "Internal server error."))


def build_app(
    llm: AsyncLLM,
    settings: AppSettings | None = None,
    lora: LoRAConfig | None = None,
    images: ImageFront | None = None,
) -> Starlette:
    """The ASGI app serving `llm` (and the LoRA adapters of `lora`; `images`: the model's image processor and the
    media policy, None: no images); its lifespan starts the engine thread and stops it at shutdown."""
    settings = settings or AppSettings()
    routes = _Routes(llm, settings, lora, images)
    extra: list[Route] = []
    if routes.loras is not None and routes.loras.allow_runtime_updating:
        lora_routes = LoRARoutes(llm, routes.loras, routes.ctx.served_model_name, routes._body)
        extra = [
            Route("/v1/load_lora_adapter", lora_routes.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", lora_routes.unload, methods=["POST"]),
        ]
    sleep = SleepRoutes(llm)
    dashboard = FrameProducer(llm, owners=routes.ctx.owners)
    llm.metrics.registry.register(
        _GrammarCacheCollector(routes.grammars, llm.metrics.prefix, llm.served_model_name)
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        llm.start()
        routes.start_background()
        try:
            yield
        finally:
            routes.responses_store.cancel_all()
            await dashboard.close()
            await asyncio.to_thread(llm.shutdown)
            routes.executor.shutdown(wait=False, cancel_futures=True)
            routes.grammars.shutdown()

    middleware: list[Middleware] = []
    api_keys, admin_keys = settings.api_keys(), settings.admin_api_keys()
    if api_keys or admin_keys:
        middleware.append(
            Middleware(
                APIKeyMiddleware,
                api_keys=api_keys,
                isolate=settings.isolate_prefix_cache_per_key,
                admin_keys=admin_keys,
            )
        )
    handlers: dict[Any, Any] = {
        APIError: _api_error,
        RequestRejectedError: _rejected,
        HTTPException: _http_error,
        ClientDisconnectedError: _client_left,
        Exception: _internal_error,
    }
    return Starlette(
        routes=[
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat, methods=["POST"]),
            Route("/v1/responses", routes.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", routes.get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", routes.delete_response, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", routes.cancel_response, methods=["POST"]),
            Route("/v1/embeddings", routes.embeddings, methods=["POST"]),
            Route("/v1/messages", routes.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"]),
            *[Route(path, routes.score, methods=["POST"]) for path in SCORE_PATHS],
            *[Route(path, routes.rerank, methods=["POST"]) for path in RERANK_PATHS],
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/tokenize", routes.tokenize, methods=["POST"]),
            Route("/detokenize", routes.detokenize, methods=["POST"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/openapi.json", routes.openapi_json, methods=["GET"]),
            Route("/sleep", sleep.sleep, methods=["POST"]),
            Route("/wake_up", sleep.wake_up, methods=["POST"]),
            Route("/is_sleeping", sleep.is_sleeping, methods=["GET"]),
            *extra,
            *dashboard_routes(dashboard),
        ],
        middleware=middleware,
        exception_handlers=handlers,
        lifespan=lifespan,
    )
