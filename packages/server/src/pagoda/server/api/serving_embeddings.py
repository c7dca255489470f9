"""POST /v1/embeddings: one pooling request per input on the pooling runner (`--runner pooling`)."""

from __future__ import annotations

import base64
import struct
import uuid
from collections.abc import Sequence

from pagoda.server.api.cache_scope import request_scope
from pagoda.server.api.errors import APIError, bad_request
from pagoda.server.api.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PromptTokensDetails,
)
from pagoda.server.api.serving_base import ServingContext, final_outputs, until_disconnect
from pagoda.server.pooling import PoolingParams
from pagoda.server.sampling_params import SamplingParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

Prompt = tuple[str | None, list[int]]


def encode_base64(vector: Sequence[float]) -> str:
    """OpenAI's base64 encoding of a vector: its float32 values, little-endian, base64 (the client decodes it)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingsHandler:
    """Validates an embeddings request, pools each input on the engine and formats the response."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def _inputs(self, body: EmbeddingRequest) -> list[Prompt]:
        """Each input as (text or None, token ids); a 400 naming `input` when one is empty, too long or not ids
        of the vocabulary."""
        raw = body.input
        if isinstance(raw, str):
            items: list[str | list[int]] = [raw]
        elif not raw:
            raise bad_request("input must not be empty", "input")
        elif isinstance(raw[0], int):
            items = [[int(t) for t in raw if isinstance(t, int)]]
        else:
            items = [item for item in raw if isinstance(item, str | list)]
        limit = self.ctx.limits.max_prompts_per_request
        if len(items) > limit:
            raise bad_request(
                f"the request has {len(items)} inputs, more than --max-prompts-per-request ({limit})", "input"
            )
        texts = [item for item in items if isinstance(item, str)]
        for text in texts:
            if not text:
                raise bad_request("input must not contain an empty string", "input")
            self.ctx.check_prompt_chars(text, "input")
        encoded = iter(await self.ctx.encode(texts, add_special_tokens=body.add_special_tokens))
        prompts: list[Prompt] = [
            (item, next(encoded)) if isinstance(item, str) else (None, item) for item in items
        ]
        for _, ids in prompts:
            self.ctx.rules.max_tokens(ids, 1, "input")  # empty, too long, or outside the vocabulary
        return prompts

    async def create(self, body: EmbeddingRequest, request: Request) -> Response:
        """Serve one embeddings request (the engine refuses it, naming the runner to start, on a generate one)."""
        ctx = self.ctx
        ctx.check_model(body.model)
        prompts = await self._inputs(body)
        # The engine fills in its --pooler-config (and refuses the request on a generate runner).
        params = SamplingParams(temperature=0.0, max_tokens=1, pooling=PoolingParams(body.dimensions))
        request_id = f"embd-{uuid.uuid4().hex}"
        streams = await ctx.open_streams(request_id, prompts, params, cache_scope=request_scope(request))
        try:
            finals = await until_disconnect(request, final_outputs(streams))
        finally:
            for stream in streams:
                stream.close()
        data: list[EmbeddingData] = []
        for index, final in enumerate(finals):
            if final.embedding is None:  # aborted (shutdown, a stalled reader): no vector to give
                raise APIError(
                    503, "The embedding request was aborted before it finished. Retry the request."
                )
            vector = final.embedding
            value: list[float] | str = (
                encode_base64(vector) if body.encoding_format == "base64" else list(vector)
            )
            data.append(EmbeddingData(index=index, embedding=value))
        num_tokens = sum(len(ids) for _, ids in prompts)
        usage = EmbeddingUsage(
            prompt_tokens=num_tokens,
            total_tokens=num_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(f.num_cached_tokens for f in finals)),
        )
        response = EmbeddingResponse(id=request_id, model=ctx.served_model_name, data=data, usage=usage)
        return JSONResponse(response.model_dump())
