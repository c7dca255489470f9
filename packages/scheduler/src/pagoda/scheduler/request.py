"""A request's state as the scheduler tracks it (after vLLM v1's `Request` and `RequestStatus`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.scheduler.protocols import SamplingParamsLike
from pagoda.scheduler.slo import RequestSLO


class RequestRejectedError(ValueError):
    """A request refused at admission (it can never run, or its id is taken); `param` names the field at fault.

    `param` uses the OpenAI request fields ("prompt", "max_tokens", "n", ...) so that an engine can relay it
    to its clients unchanged; None when no single field is at fault. The server's engine raises this class too.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def sample_id(request_id: str, index: int) -> str:
    """The sequence id of sample `index` of a request: the request's own id for 0, else f"{request_id}:{index}"."""
    return request_id if index == 0 else f"{request_id}:{index}"


@dataclass(frozen=True, slots=True)
class EncoderSpan:
    """Prompt positions whose inputs an encoder computes (an image's placeholder tokens).

    The allocator hashes `content_key` at these positions in place of the token ids (`Request.block_key_ids`),
    so the prefix cache hits on the same content and never on other content behind the same placeholder ids.
    An `atomic` span is attended in both directions: no prefill chunk may end inside it.
    """

    offset: int  # first position
    length: int  # positions
    content_key: int  # a digest of the content, negative (no token id equals it)
    atomic: bool = False

    @property
    def end(self) -> int:
        """One past its last position."""
        return self.offset + self.length


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # in the waiting queue (recompute) or in the host tier (swap)
    FINISHED_STOPPED = enum.auto()  # a stop token (or the engine's stop string)
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """Whether `status` is one of the finished ones."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """OpenAI-style reason ("stop", "length", "abort") of a finished status, None while unfinished."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence: a prompt, its outputs so far, and how much of it has KV computed.

    The model never distinguishes prefill from decode: the scheduler gives each request a chunk of its
    `num_tokens - num_computed_tokens` uncomputed tokens. A request with `n > 1` forks, when its prompt is
    computed, into itself (sample 0) and `n - 1` children with ids `sample_id(request_id, i)`; children carry
    `parent_id` and `sample_index`, so `group_id` groups the n outputs.
    """

    __slots__ = (
        "_all_token_ids",
        "_block_keys",
        "arrival_time",
        "cache_salt",
        "chunk_start",
        "encoder_spans",
        "lora_id",
        "num_children_to_fork",
        "num_computed_tokens",
        "num_preemptions",
        "parent_id",
        "prompt_token_ids",
        "request_id",
        "sample_index",
        "sampling_params",
        "slo",
        "spec_token_ids",
        "status",
        "stop_token_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParamsLike,
        *,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        parent_id: str | None = None,
        sample_index: int = 0,
        encoder_spans: Sequence[EncoderSpan] = (),
        slo: RequestSLO | None = None,
    ) -> None:
        """A fresh WAITING request; `arrival_time` is on the clock the policies use; `encoder_spans` (in prompt
        order, disjoint, inside the prompt) mark its images."""
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt  # isolates prefix-cache sharing (e.g. per tenant)
        self.lora_id = lora_id  # the LoRA adapter it runs under (None: the base model); see max_loras
        self.parent_id = parent_id
        self.sample_index = sample_index
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # num_computed_tokens before its latest scheduled chunk: what the step running now still computes
        # starts here (the encoder budget counts an image as needed until the step computing it has run).
        self.chunk_start = 0
        self.num_preemptions = 0
        self.stop_token_id: int | None = None  # the stop token that finished the request
        # Draft tokens proposed for the positions after the last token (speculative decoding): the next decode
        # step computes them with it, and `update_from_output` rolls back those the engine rejects.
        self.spec_token_ids: tuple[int, ...] = ()
        # Forks still to make when the prompt completes; children never fork again.
        self.num_children_to_fork = sampling_params.n - 1 if parent_id is None else 0
        # prompt + outputs kept as one list: the allocator hashes it and the chunk is sliced from it every step.
        self._all_token_ids = list(self.prompt_token_ids)
        self.encoder_spans: tuple[EncoderSpan, ...] = tuple(encoder_spans)
        self.slo = slo  # its own TTFT / TPOT objectives (None: its priority class's, `SchedulerConfig.slo_*`)
        # What the allocator hashes: the token ids with each span's content key at its positions (None: the
        # token ids themselves, for a request without spans).
        self._block_keys: list[int] | None = None
        if self.encoder_spans:
            self._block_keys = list(self.prompt_token_ids)
            for span in self.encoder_spans:
                if span.offset < 0 or span.length < 1 or span.end > len(self._block_keys):
                    raise RequestRejectedError(f"request {request_id!r}: span {span} is outside its prompt")
                self._block_keys[span.offset : span.end] = [span.content_key] * span.length

    def __repr__(self) -> str:
        """Short form for test failures and logs."""
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}, "
            f"tokens={self.num_tokens}, outputs={self.num_output_tokens})"
        )

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt then output token ids (read-only view)."""
        return self._all_token_ids

    @property
    def block_key_ids(self) -> Sequence[int]:
        """What the prefix cache hashes: `all_token_ids`, with each encoder span's content key at its
        positions (read-only view)."""
        return self._all_token_ids if self._block_keys is None else self._block_keys

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Sampled token ids so far."""
        return self._all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far."""
        return len(self._all_token_ids) - len(self.prompt_token_ids)

    @property
    def priority(self) -> int:
        """The sampling parameters' priority (lower is served first)."""
        return self.sampling_params.priority

    @property
    def is_finished(self) -> bool:
        """Whether the request has finished (stopped, length-capped or aborted)."""
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length", "abort", or None while unfinished."""
        return RequestStatus.finish_reason(self.status)

    @property
    def group_id(self) -> str:
        """Id shared by the n samples of one user request (the parent's id)."""
        return self.request_id if self.parent_id is None else self.parent_id

    @property
    def num_seqs(self) -> int:
        """Sequences this request will occupy in the running batch (itself plus children still to fork)."""
        return 1 + self.num_children_to_fork

    def child_ids(self) -> tuple[str, ...]:
        """Ids of the children a fork of this request creates (empty for n == 1 and for children)."""
        if not self.num_children_to_fork:
            return ()
        return tuple(sample_id(self.request_id, i) for i in range(1, self.num_children_to_fork + 1))

    def copy_as(self, child_id: str, *, parent_id: str, sample_index: int) -> Request:
        """A WAITING copy of this request's tokens (prompt and outputs) under `child_id`, in group `parent_id`."""
        child = Request(
            child_id,
            self.prompt_token_ids,
            self.sampling_params,
            arrival_time=self.arrival_time,
            cache_salt=self.cache_salt,
            lora_id=self.lora_id,
            parent_id=parent_id,
            sample_index=sample_index,
            encoder_spans=self.encoder_spans,
            slo=self.slo,
        )
        child._all_token_ids = list(self._all_token_ids)
        if self._block_keys is not None:
            child._block_keys = list(self._block_keys)
        return child

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token (its KV is computed in a later step)."""
        self._all_token_ids.append(token_id)
        if self._block_keys is not None:
            self._block_keys.append(token_id)
