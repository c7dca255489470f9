"""POST /score and POST /rerank on the pooling runner: a cross-encoder's score of each pair, or the cosine of their
embeddings on an embedding model (vLLM's two paths).

A sequence-classification model (`LlamaForSequenceClassification`, Qwen2, Qwen3) reads each pair as one prompt,
encoded as transformers' cross-encoders do (`tokenizer(text_1, text_2)`: the tokenizer's pair encoding); the
engine runs its head on the pooled row (`pooling.classifier.ScoreHead`). An embedding model embeds each distinct
text once and scores a pair by the cosine of its two vectors.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.server.api.cache_scope import request_scope
from pagoda.server.api.errors import APIError, bad_request
from pagoda.server.api.protocol import PromptTokensDetails
from pagoda.server.api.score_protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)
from pagoda.server.api.serving_base import ServingContext, final_outputs, until_disconnect
from pagoda.server.engine.admission import RequestRejectedError
from pagoda.server.outputs import RequestOutput
from pagoda.server.pooling import PoolingParams, SupportedTask
from pagoda.server.pooling.scoring import ScoreInputError, cosine, pair_up, ranking
from pagoda.server.sampling_params import SamplingParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

Prompt = tuple[str | None, list[int]]


@dataclass(frozen=True, slots=True)
class Scored:
    """The scores of a request's pairs, in pair order, and the prompt tokens the engine ran for them."""

    scores: list[float]
    prompt_tokens: int
    cached_tokens: int


class ScoreHandler:
    """Validates a score or rerank request, runs its prompts on the engine and formats the answer."""

    def __init__(self, ctx: ServingContext, supported_tasks: Sequence[SupportedTask]) -> None:
        self.ctx = ctx
        self.tasks = tuple(supported_tasks)

    async def score(self, body: ScoreRequest, request: Request) -> Response:
        """POST /score: one score per pair of `text_1` and `text_2`."""
        self._check(body.model)
        try:
            pairs = pair_up(body.text_1, body.text_2)
        except ScoreInputError as exc:
            raise bad_request(str(exc), exc.param) from exc
        request_id = f"score-{uuid.uuid4().hex}"
        scored = await self._run(request_id, pairs, ("text_1", "text_2"), body.use_activation, request)
        usage = ScoreUsage(
            prompt_tokens=scored.prompt_tokens,
            total_tokens=scored.prompt_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=scored.cached_tokens),
        )
        data = [ScoreData(index=i, score=score) for i, score in enumerate(scored.scores)]
        response = ScoreResponse(id=request_id, model=self.ctx.served_model_name, data=data, usage=usage)
        return JSONResponse(response.model_dump())

    async def rerank(self, body: RerankRequest, request: Request) -> Response:
        """POST /rerank: the documents by their score against the query, highest first, the first top_n."""
        self._check(body.model)
        documents = [doc if isinstance(doc, str) else doc.text for doc in body.documents]
        if not documents:
            raise bad_request("documents must not be empty", "documents")
        request_id = f"rerank-{uuid.uuid4().hex}"
        pairs = [(body.query, doc) for doc in documents]
        scored = await self._run(request_id, pairs, ("query", "documents"), body.use_activation, request)
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=documents[i]) if body.return_documents else None,
                relevance_score=scored.scores[i],
            )
            for i in ranking(scored.scores, body.top_n)
        ]
        usage = RerankUsage(prompt_tokens=scored.prompt_tokens, total_tokens=scored.prompt_tokens)
        response = RerankResponse(
            id=request_id, model=self.ctx.served_model_name, usage=usage, results=results
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    def _check(self, model: str | None) -> None:
        """404 for another model; 400 naming the runner on a server that does not score."""
        self.ctx.check_model(model)
        if "score" not in self.tasks:
            raise bad_request(
                "this server runs the generate runner, which serves completions and chat; /score and /rerank "
                "need a server started with --runner pooling on a sequence-classification (cross-encoder) or "
                "embedding model",
                "model",
            )

    async def _run(
        self,
        request_id: str,
        pairs: list[tuple[str, str]],
        fields: tuple[str, str],
        use_activation: bool | None,
        request: Request,
    ) -> Scored:
        """The scores of `pairs`: a cross-encoder's, or the cosines of embeddings where the engine embeds."""
        for first, second in pairs:  # each text alone beyond the bound makes its pair too long
            self.ctx.check_prompt_chars(first, fields[0])
            self.ctx.check_prompt_chars(second, fields[1])
        if "embed" in self.tasks:
            return await self._cosines(request_id, pairs, fields, request)
        prompts = await self._pair_prompts(pairs, fields)
        params = PoolingParams(task="score", use_activation=use_activation is not False)
        finals = await self._pool(request_id, prompts, params, request)
        return Scored(
            [_pooled(final)[0] for final in finals],
            sum(len(ids) for _, ids in prompts),
            sum(final.num_cached_tokens for final in finals),
        )

    async def _pair_prompts(self, pairs: list[tuple[str, str]], fields: tuple[str, str]) -> list[Prompt]:
        """Each pair as one prompt, the tokenizer's pair encoding (transformers' `tokenizer(text_1, text_2)`);
        a 400 naming the second field for too many pairs or a pair too long for max_model_len."""
        self._check_count(len(pairs), fields[1])
        tokenizer = self.ctx.tokenizer

        def work() -> list[list[int]]:
            return [list(tokenizer(first, second)["input_ids"]) for first, second in pairs]

        encoded = await self.ctx.run(work)
        for index, ids in enumerate(encoded):
            self._check_ids(ids, fields[1], index)
        return [(None, ids) for ids in encoded]

    async def _cosines(
        self, request_id: str, pairs: list[tuple[str, str]], fields: tuple[str, str], request: Request
    ) -> Scored:
        """Embed each distinct text once; each pair's score is the cosine of its two vectors."""
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        self._check_count(len(texts), fields[1])
        encoded = await self.ctx.encode(texts, add_special_tokens=True)
        field_of = {text: fields[1] for _, text in pairs} | {text: fields[0] for text, _ in pairs}
        for index, (text, ids) in enumerate(zip(texts, encoded, strict=True)):
            self._check_ids(ids, field_of[text], index)
        prompts: list[Prompt] = [(text, ids) for text, ids in zip(texts, encoded, strict=True)]
        finals = await self._pool(request_id, prompts, PoolingParams(task="embed"), request)
        vectors = {text: _pooled(final) for text, final in zip(texts, finals, strict=True)}
        return Scored(
            [cosine(vectors[first], vectors[second]) for first, second in pairs],
            sum(len(ids) for ids in encoded),
            sum(final.num_cached_tokens for final in finals),
        )

    def _check_count(self, count: int, field: str) -> None:
        """400 naming `field` when a request needs more prompts than --max-prompts-per-request."""
        limit = self.ctx.limits.max_prompts_per_request
        if count > limit:
            raise bad_request(
                f"the request needs {count} prompts, more than --max-prompts-per-request ({limit})", field
            )

    def _check_ids(self, ids: list[int], field: str, index: int) -> None:
        """400 naming `field` for a prompt that is empty, too long or outside the vocabulary."""
        try:
            self.ctx.rules.max_tokens(ids, 1, field)
        except RequestRejectedError as exc:
            raise bad_request(f"prompt {index}: {exc}", field) from exc

    async def _pool(
        self, request_id: str, prompts: list[Prompt], pooling: PoolingParams, request: Request
    ) -> list[RequestOutput]:
        """Run the prompts as pooling requests (one admission); their final outputs, in order."""
        params = SamplingParams(temperature=0.0, max_tokens=1, pooling=pooling)
        streams = await self.ctx.open_streams(request_id, prompts, params, cache_scope=request_scope(request))
        try:
            return await until_disconnect(request, final_outputs(streams))
        finally:
            for stream in streams:
                stream.close()


def _pooled(final: RequestOutput) -> tuple[float, ...]:
    """A finished pooling request's output; 503 when it was aborted (shutdown, a stalled reader)."""
    if final.embedding is None:
        raise APIError(503, "The score request was aborted before it finished. Retry the request.")
    return final.embedding
