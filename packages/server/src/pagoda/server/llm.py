"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, cast

from pagoda.server.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagoda.server.chat import Message, render_chat, resolve_chat_template
from pagoda.server.config import EngineConfig
from pagoda.server.engine import LLMEngine
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.spec.config import parse_speculative_config
from tqdm.auto import tqdm

Prompt = str | Sequence[int]


class LLM:
    """Generate for a batch of prompts at once, continuously batched; `model=None` is Gemma 3 270M."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """Build the engine; keywords are the engine config's flat names (max_num_seqs, block_size, ...: the
        `pagoda serve` flags with underscores), given to their sections by `EngineConfig.from_flat`;
        `speculative_config` also takes vLLM's dict (or its JSON text)."""
        if engine_args.get("speculative_config") is not None:
            engine_args["speculative_config"] = parse_speculative_config(engine_args["speculative_config"])
        self.engine = LLMEngine.from_config(EngineConfig.from_flat(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs in prompt order."""
        batch = _as_batch(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(batch)
        else:
            params_list = list(params)
        if len(params_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params_list)} SamplingParams")
        order: dict[str, int] = {}
        for index, (prompt, sp) in enumerate(zip(batch, params_list, strict=True)):
            request_id = f"offline-{next(self._ids)}"
            self.engine.rules.check_constraint(sp)  # the front end's parse: the engine only compiles
            if isinstance(prompt, str):
                token_ids = self.tokenizer.encode(prompt)
                self.engine.add_request(request_id, token_ids, sp, prompt=prompt)
            else:
                self.engine.add_request(request_id, list(prompt), sp)
            order[request_id] = index
        results: list[RequestOutput | None] = [None] * len(batch)
        with tqdm(total=len(batch), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in order:
                        results[order.pop(output.request_id)] = output
                        bar.update(1)
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

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
    ) -> list[RequestOutput]:
        """Render conversations with the tokenizer's chat template and generate each assistant reply."""
        single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if single else messages
        template = resolve_chat_template(self.tokenizer)
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = render_chat(self.tokenizer, template, cast(Sequence[Message], conversation))
            # The template wrote the special tokens (BOS) itself.
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, params, use_tqdm=use_tqdm)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A single prompt (text or one token-id list) as a batch of one; a batch as a list."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
