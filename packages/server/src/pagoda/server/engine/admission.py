"""The request rules of one model, written once: the engine checks every request with them, and the API calls
them earlier to name its own fields and to default max_tokens to the room a prompt leaves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.scheduler import RequestRejectedError
from pagoda.server.handoff import Resume, can_resume
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.structured import GrammarError, parse_grammar

__all__ = ["AdmissionRules", "RequestRejectedError", "check_resume"]


@dataclass(frozen=True, slots=True)
class AdmissionRules:
    """A prompt is not empty, not longer than max_input_tokens, every token id is in the vocabulary, prompt +
    max_tokens fit max_model_len, and (`check_constraint`, a front end's call) a structured-outputs constraint
    parses.

    Each rule raises RequestRejectedError naming the field at fault. Whether the request fits the KV pool and the
    batch (`n`) is the scheduler's check, made when the engine hands the request over.
    """

    max_model_len: int
    vocab_size: int
    max_input_tokens: int | None = None  # TGI's --max-input-tokens; None: only max_model_len bounds a prompt

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        """Reject an id outside the vocabulary [0, vocab_size)."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejectedError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param
            )

    def max_tokens(
        self, prompt_token_ids: Sequence[int], max_tokens: int | None, param: str = "prompt"
    ) -> int:
        """Check a prompt (named `param`) and its max_tokens; the max_tokens to use (None: all the room left)."""
        num_prompt = len(prompt_token_ids)
        if not num_prompt:
            raise RequestRejectedError("the prompt is empty", param)
        if self.max_input_tokens is not None and num_prompt > self.max_input_tokens:
            raise RequestRejectedError(
                f"the prompt has {num_prompt} tokens, more than max_input_tokens ({self.max_input_tokens})",
                param,
            )
        self.check_token_ids(prompt_token_ids, param)
        room = self.max_model_len - num_prompt
        if room < 0:
            raise RequestRejectedError(
                f"the prompt has {num_prompt} tokens, more than max_model_len ({self.max_model_len})", param
            )
        if max_tokens is None:
            if room < 1:
                raise RequestRejectedError(
                    f"the prompt has {num_prompt} tokens and leaves no room to generate within max_model_len "
                    f"({self.max_model_len})",
                    param,
                )
            return room
        if max_tokens > room:
            raise RequestRejectedError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                f"({self.max_model_len})",
                "max_tokens",
            )
        return max_tokens

    def check(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, prompt_param: str = "prompt"
    ) -> None:
        """Every rule for one engine request: the prompt (named `prompt_param` in an error), its max_tokens, and
        the token ids of its parameters (cheap: the constraint's parse is `check_constraint`, made by the front
        end)."""
        self.max_tokens(prompt_token_ids, params.max_tokens, prompt_param)
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(params.logit_bias or {}), "logit_bias")
        self.check_token_ids(params.allowed_token_ids or (), "allowed_token_ids")

    def check_constraint(self, params: SamplingParams) -> None:
        """The structured-outputs constraint parses (front ends call it before the engine sees the request: the
        engine thread only compiles it, on its pool)."""
        if params.structured_outputs is not None:
            try:
                parse_grammar(params.structured_outputs)
            except GrammarError as exc:
                field = "structured_outputs" if exc.kind is None else f"structured_outputs.{exc.kind}"
                raise RequestRejectedError(str(exc), field) from exc


def check_resume(params: SamplingParams, resume: Resume) -> None:
    """RequestRejectedError naming `resume` unless the request can go on from `resume`'s outputs here."""
    if not can_resume(params):
        raise RequestRejectedError(
            "only a request of one plain sample without prompt logprobs can be resumed", "resume"
        )
    if not 0 < len(resume.output_token_ids) < params.max_tokens:
        raise RequestRejectedError(
            f"a resumed request needs 1 to max_tokens - 1 outputs so far, not {len(resume.output_token_ids)}",
            "resume",
        )
