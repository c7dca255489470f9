"""The offline API: `LLM(model).generate(prompts, params)`, `LLM.chat(messages)` and, on the pooling runner,
`LLM(model, runner="pooling").embed(prompts)`, `.score(text_1, text_2)` and `.rerank(query, documents)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, cast

from pagoda.server.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagoda.server.chat import Message, check_template_kwargs, render_chat, resolve_chat_template
from pagoda.server.config import EngineConfig
from pagoda.server.engine import LLMEngine
from pagoda.server.lora import LoRARequest
from pagoda.server.multimodal.folder import model_processor
from pagoda.server.multimodal.inputs import ProcessedPrompt
from pagoda.server.multimodal.media import MediaPolicy
from pagoda.server.multimodal.offline import (
    chat_images,
    check_marker,
    dict_prompt_images,
    dict_prompt_tokens,
    process_images,
)
from pagoda.server.multimodal.processor import MultiModalProcessor
from pagoda.server.outputs import RequestOutput
from pagoda.server.pooling import PoolingParams
from pagoda.server.pooling.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RerankOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.server.pooling.scoring import cosine, pair_up, ranking
from pagoda.server.sampling_params import SamplingParams
from tqdm.auto import tqdm

# Text, token ids, vLLM's dict with images ({"prompt": text, "multi_modal_data": {"image": images}}), or a prompt
# the model's processor already expanded.
Prompt = str | Sequence[int] | Mapping[str, Any] | ProcessedPrompt


class LLM:
    """Generate for a batch of prompts at once, continuously batched; `model=None` is the default model
    (`pagoda serve`'s: SmolLM2-135M-Instruct), a short name such as "gemma3-270m" a packaged one."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """Build the engine; keywords are the engine config's flat names (max_num_seqs, block_size, ...: the
        `pagoda serve` flags with underscores), given to their sections by `EngineConfig.from_flat`, which parses
        `speculative_config`, `pooler_config` and `kv_events_config` given as vLLM's dict (or its JSON text)."""
        config = EngineConfig.from_flat(model=model, **engine_args)
        # The image policy first: a bad allowed_local_media_path is refused before the model loads.
        self.media_policy = MediaPolicy.from_config(config.multimodal_config)
        self.engine = LLMEngine.from_config(config)
        self.tokenizer = self.engine.tokenizer
        # The model folder's image processor; None: a text-only model.
        self.mm_processor: MultiModalProcessor | None = model_processor(self.engine.model_path)
        self._ids = itertools.count()

    def sleep(self, level: int = 1) -> None:
        """vLLM's offline sleep (with `enable_sleep_mode=True`): free the KV pool and release the weights' memory
        (see `LLMEngine.sleep`); `wake_up` brings them back."""
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what `tags` name ("weights", "kv_cache"; None: both) after `sleep`."""
        self.engine.wake_up(tags)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (text, token ids, or vLLM's dict prompts) to completion; outputs in prompt order.
        `lora_request` (one, or one per prompt; `LLM(enable_lora=True)`) runs prompts under an adapter, read now if
        it is new. A refused prompt raises, and none of the batch runs."""
        batch = _as_batch(prompts)
        loras = self._loras(lora_request, len(batch))
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(batch)
        else:
            params_list = list(params)
        if len(params_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params_list)} SamplingParams")
        order: dict[str, int] = {}
        try:
            for index, (prompt, sp, lora) in enumerate(zip(batch, params_list, loras, strict=True)):
                request_id = f"offline-{next(self._ids)}"
                self.engine.rules.check_constraint(sp)  # the front end's parse: the engine only compiles
                self._add_prompt(request_id, index, prompt, sp, lora)
                order[request_id] = index
        except BaseException:
            # A refused prompt fails the whole call, so the ones queued before it must not run on unseen.
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        results: list[RequestOutput | None] = [None] * len(batch)
        with tqdm(total=len(batch), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in order:
                        results[order.pop(output.request_id)] = output
                        bar.update(1)
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _add_prompt(
        self, request_id: str, index: int, prompt: Prompt, params: SamplingParams, lora: LoRARequest | None
    ) -> None:
        """Queue prompt `index` of a batch in whichever of the offline API's forms it comes (a refusal names the
        argument: `prompts[1]`, `prompts[1].prompt_token_ids`)."""
        where = f"prompts[{index}]"
        if isinstance(prompt, ProcessedPrompt):
            self.engine.add_request(
                request_id,
                list(prompt.token_ids),
                params,
                lora_request=lora,
                multi_modal=prompt.multi_modal,
                prompt_param=where,
            )
        elif isinstance(prompt, Mapping) and (ids := dict_prompt_tokens(prompt, index)) is not None:
            self.engine.add_request(
                request_id, ids, params, lora_request=lora, prompt_param=f"{where}.prompt_token_ids"
            )
        elif isinstance(prompt, Mapping):
            text, images = dict_prompt_images(prompt, index)
            self._add_text(request_id, text, images, params, lora, f"{where}.prompt")
        elif isinstance(prompt, str):
            self._add_text(request_id, prompt, [], params, lora, where)
        else:
            self.engine.add_request(request_id, list(prompt), params, lora_request=lora, prompt_param=where)

    def _add_text(
        self,
        request_id: str,
        text: str,
        images: Sequence[tuple[object, str]],
        params: SamplingParams,
        lora: LoRARequest | None,
        name: str,
    ) -> None:
        """Queue a text prompt, with its images expanded by the model's processor (MediaError naming the argument
        of a refused image)."""
        if not images:
            check_marker(text, self.mm_processor, name)
            token_ids = self.tokenizer.encode(text)
            self.engine.add_request(
                request_id, token_ids, params, prompt=text, lora_request=lora, prompt_param=name
            )
            return
        processed = process_images(text, images, self.mm_processor, self.media_policy)
        self.engine.add_request(
            request_id,
            list(processed.token_ids),
            params,
            prompt=text,
            lora_request=lora,
            multi_modal=processed.multi_modal,
            prompt_param=name,
        )

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        dimensions: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Pool every prompt (text or token ids) into one vector, continuously batched, prefill only: needs
        `LLM(runner="pooling")`; `pooler_config` sets the pooling; `dimensions` cuts a Matryoshka model's vector."""
        params = SamplingParams(temperature=0.0, max_tokens=1, pooling=PoolingParams(dimensions))
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        results: list[EmbeddingRequestOutput] = []
        for output in outputs:
            assert output.embedding is not None, "a finished pooling request carries its vector"
            results.append(
                EmbeddingRequestOutput(
                    output.request_id,
                    output.prompt_token_ids,
                    EmbeddingOutput(output.embedding),
                    output.num_cached_tokens,
                )
            )
        return results

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        use_activation: bool = True,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """Score text pairs (vLLM's call; `LLM(runner="pooling")`): a string pairs with each item of a list, lists
        of equal length item by item (`pooling.scoring.pair_up`; ScoreInputError naming the argument otherwise).
        A sequence-classification model scores each pair as one prompt, `tokenizer(text_1, text_2)`, through its
        head (sigmoid, or the raw logit of a regression head or with `use_activation=False`); an embedding model
        gives the cosine of the two texts' embeddings. One output per pair, in order."""
        return self._score_pairs(pair_up(text_1, text_2), use_activation, use_tqdm)

    def _score_pairs(
        self, pairs: list[tuple[str, str]], use_activation: bool, use_tqdm: bool
    ) -> list[ScoringRequestOutput]:
        """The scores of `pairs` (see `score`)."""
        if "embed" in self.engine.supported_tasks:
            texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            embedded = dict(zip(texts, self.embed(texts, use_tqdm=use_tqdm), strict=True))
            scored = []
            for first, second in pairs:
                a, b = embedded[first], embedded[second]
                scored.append(
                    ScoringRequestOutput(
                        f"{a.request_id}+{b.request_id}",
                        a.prompt_token_ids + b.prompt_token_ids,
                        ScoringOutput(cosine(a.outputs.embedding, b.outputs.embedding)),
                        a.num_cached_tokens + b.num_cached_tokens,
                    )
                )
            return scored
        pooling = PoolingParams(task="score", use_activation=use_activation)
        params = SamplingParams(temperature=0.0, max_tokens=1, pooling=pooling)
        prompts = [list(self.tokenizer(first, second)["input_ids"]) for first, second in pairs]
        results: list[ScoringRequestOutput] = []
        for output in self.generate(prompts, params, use_tqdm=use_tqdm):
            assert output.embedding is not None, "a finished score request carries its score"
            results.append(
                ScoringRequestOutput(
                    output.request_id,
                    output.prompt_token_ids,
                    ScoringOutput(output.embedding[0]),
                    output.num_cached_tokens,
                )
            )
        return results

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        use_activation: bool = True,
        use_tqdm: bool = True,
    ) -> list[RerankOutput]:
        """The documents by their `score` against the query, highest first (ties in document order), the first
        `top_n` (None or 0: all): what POST /rerank answers."""
        pairs = pair_up(query, documents, ("query", "documents"))
        scores = [out.outputs.score for out in self._score_pairs(pairs, use_activation, use_tqdm)]
        return [RerankOutput(i, documents[i], scores[i]) for i in ranking(scores, top_n)]

    def _loras(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt; adapters the engine does not serve yet are read and served now."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * count
        else:
            loras = list(lora_request)
        if len(loras) != count:
            raise ValueError(f"{count} prompts but {len(loras)} lora_request entries")
        for lora in dict.fromkeys(loras):
            if lora is not None and lora not in self.engine.list_loras():
                self.engine.add_lora(lora)
        return loras

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """Beam-search every prompt, continuously batched; per prompt its beam_width sequences, best first."""
        outputs = self.generate(prompts, SamplingParams.for_beam_search(params), use_tqdm=use_tqdm)
        return [
            BeamSearchOutput(
                tuple(
                    BeamSearchSequence(
                        tokens=o.token_ids,
                        text=o.text,
                        cum_logprob=o.cumulative_logprob or 0.0,
                        score=(o.cumulative_logprob or 0.0) / len(o.token_ids) ** params.length_penalty,
                        finish_reason="stop" if o.finish_reason == "stop" else "length",
                    )
                    for o in output.outputs
                )
            )
            for output in outputs
        ]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render conversations with the tokenizer's chat template and generate each assistant reply.

        `tools` (OpenAI's `{"type": "function", "function": {...}}` entries) go to the template's `tools`
        variable; `chat_template_kwargs` become template variables (`enable_thinking`), as vLLM's LLM.chat.
        """
        single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if single else messages
        template = resolve_chat_template(self.tokenizer)
        if chat_template_kwargs:
            check_template_kwargs(self.tokenizer, chat_template_kwargs)
        prompts: list[Prompt] = []
        for index, conversation in enumerate(conversations):
            # Image parts (image_url, image_pil) become the template's {"type": "image"}.
            messages, images = chat_images(cast(Sequence[Message], conversation), index)
            text = render_chat(
                self.tokenizer, template, messages, template_kwargs=chat_template_kwargs, tools=tools
            )
            if images:
                prompts.append(
                    process_images(
                        text, images, self.mm_processor, self.media_policy, add_special_tokens=False
                    )
                )
            else:
                check_marker(text, self.mm_processor, f"messages[{index}]")
                # The template wrote the special tokens (BOS) itself.
                prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, params, use_tqdm=use_tqdm)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A single prompt (text, one token-id list, a dict or a processed prompt) as a batch of one; a batch as a
    list."""
    if isinstance(prompts, str | Mapping | ProcessedPrompt):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
