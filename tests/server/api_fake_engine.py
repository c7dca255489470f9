"""Test support for the API: a deterministic in-memory engine behind the EngineClient Protocol, a character
tokenizer, and an in-process uvicorn server running the app on a free port."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from pagoda.server.api import AppSettings, build_app
from pagoda.server.api.http_protocol import HTTPConfig
from pagoda.server.api.images import ImageFront
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.config import HTTPLimits, ServingConfig
from pagoda.server.engine import RequestRejectedError
from pagoda.server.engine_client import EngineClient
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput
from pagoda.server.pooling import SupportedTask
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import free_port
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?:;'\"-_()\n"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
FAIL_STEP_MARKER = "@@fail-step@@"  # a prompt containing this makes the fake engine's step raise
REJECT_MARKER = "@@reject@@"  # a prompt containing this makes add_request raise RequestRejectedError


def make_char_tokenizer(*, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with Gemma's turn markers; adds <bos> as the first special token."""
    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(ALPHABET)))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIALS)  # matched whole, before the per-character split
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves __init__ untyped
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


@dataclass
class _Seq:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival: float
    seqs: list[_Seq]
    running: bool = False


class FakeEngine:
    """A deterministic engine: each running sample gets one letter per step, chosen from the prompt and index.

    Runs at most `max_num_seqs` samples per step (the rest wait), sleeps `step_seconds` per step to stand in
    for the model, honours max_tokens, stop strings, n, logprobs and abort, and counts KV blocks like a pager.
    """

    def __init__(
        self,
        *,
        max_model_len: int = 128,
        max_num_seqs: int = 64,
        num_kv_blocks: int = 512,
        block_size: int = 4,
        step_seconds: float = 0.0,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = make_char_tokenizer(chat_template=chat_template)
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.vocab_size = len(self.tokenizer)
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.supported_tasks: tuple[SupportedTask, ...] = ("generate",)
        self.max_num_seqs = max_num_seqs
        self.step_seconds = step_seconds
        self.requests: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.num_steps = 0
        self.last_params: SamplingParams | None = None  # the latest request's
        self._finished_aborts: list[RequestOutput] = []
        vocab = self.tokenizer.get_vocab()
        self._letter_ids = [vocab[c] for c in LETTERS]

    # The EngineClient surface ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> None:
        """Queue a request (raises RequestRejectedError for a prompt with REJECT_MARKER or over max_model_len)."""
        if prompt is not None and REJECT_MARKER in prompt:
            raise RequestRejectedError("rejected by the fake engine", "prompt")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise RequestRejectedError("too long", "max_tokens")
        self.last_params = params
        seqs = [_Seq(index=i) for i in range(params.n)]
        self.requests[request_id] = _Req(
            request_id, prompt, tuple(prompt_token_ids), params, arrival_time or time.monotonic(), seqs
        )

    def abort_request(self, request_id: str) -> None:
        """Drop a request at once (its blocks are free from now on)."""
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued."""
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Give every running sample one more token; admit waiting requests while seats are free."""
        self.num_steps += 1
        if self.step_seconds:
            time.sleep(self.step_seconds)
        seats = self.max_num_seqs - sum(len(r.seqs) for r in self.requests.values() if r.running)
        for req in self.requests.values():
            # A request wider than the whole batch still runs alone, as a real engine would run it.
            if not req.running and (len(req.seqs) <= seats or seats == self.max_num_seqs):
                req.running = True
                seats -= len(req.seqs)
                self.prompt_tokens += len(req.prompt_token_ids)
        outputs = []
        for req in list(self.requests.values()):
            if not req.running:
                continue
            if req.prompt is not None and FAIL_STEP_MARKER in req.prompt:
                raise RuntimeError("simulated engine failure")
            for seq in req.seqs:
                if seq.finish_reason is None:
                    self._advance(req, seq)
            finished = all(s.finish_reason is not None for s in req.seqs)
            outputs.append(self._snapshot(req, finished))
            if finished:
                del self.requests[req.request_id]
        return outputs

    def check_health(self) -> None:
        """The fake never dies on its own."""

    def close(self) -> None:
        """The fake holds nothing outside this process."""

    def get_stats(self) -> EngineStats:
        """Counts of the fake's queues and blocks."""
        running = [r for r in self.requests.values() if r.running]
        used = sum(
            math.ceil((len(r.prompt_token_ids) + len(s.token_ids)) / self.block_size)
            for r in running
            for s in r.seqs
        )
        return EngineStats(
            num_running=len(running),
            num_waiting=len(self.requests) - len(running),
            num_swapped=0,
            kv_cache_usage=used / self.num_kv_blocks,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            prefix_cache_queries=self.prompt_tokens,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            # A fixed step shape and SLO counts, so that /metrics shows their families.
            token_budget=64,
            chunk_size=32,
            max_num_seqs=self.max_num_seqs,
            slo_attainment=((0, 3, 4, 2, 4), (1, 1, 1, 1, 1)),
            slo_sacrificed=(5, 2),
        )

    # The fake model ------------------------------------------------------------------------------------

    def next_letter(
        self, prompt_token_ids: Sequence[int], index: int, position: int, seed: int | None
    ) -> int:
        """The letter index generated at `position` of sample `index` (greedy ignores seed and index)."""
        base = sum(prompt_token_ids) + position * 7
        return (base + (0 if seed is None else seed) + index * 3) % len(LETTERS)

    def _advance(self, req: _Req, seq: _Seq) -> None:
        params = req.params
        letter = self.next_letter(req.prompt_token_ids, seq.index, len(seq.token_ids), params.seed)
        token_id = self._letter_ids[letter]
        seq.token_ids.append(token_id)
        seq.text += LETTERS[letter]
        self.generation_tokens += 1
        if params.logprobs is not None:
            position = {token_id: Logprob(logprob=-0.5, rank=1, decoded_token=LETTERS[letter])}
            for k in range(params.logprobs):
                alt = (letter + k + 1) % len(LETTERS)
                position[self._letter_ids[alt]] = Logprob(-1.0 - k, k + 2, LETTERS[alt])
            seq.logprobs.append(position)
        for stop in params.stop:
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text if params.include_stop_str_in_output else seq.text[:at]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        if len(seq.token_ids) >= params.max_tokens:
            seq.finish_reason = "length"

    def _snapshot(self, req: _Req, finished: bool) -> RequestOutput:
        outputs = tuple(
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=tuple(s.token_ids),
                cumulative_logprob=None,
                logprobs=tuple(s.logprobs) if req.params.logprobs is not None else None,
                finish_reason="stop" if s.finish_reason == "stop" else "length" if s.finish_reason else None,
                stop_reason=s.stop_reason,
            )
            for s in req.seqs
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=RequestMetrics(arrival_time=req.arrival),
        )

    def expected_text(
        self, prompt_token_ids: Sequence[int], max_tokens: int, index: int = 0, seed: int | None = None
    ) -> str:
        """What the fake generates for a prompt with no stop strings."""
        return "".join(LETTERS[self.next_letter(prompt_token_ids, index, i, seed)] for i in range(max_tokens))


@dataclass
class RunningServer:
    """A server running in this process: its base URL, engine front and fake engine."""

    base_url: str
    llm: AsyncLLM
    engine: FakeEngine


@contextmanager
def serve_in_thread(
    engine: FakeEngine,
    *,
    settings: AppSettings | None = None,
    max_waiting_requests: int | None = None,
    max_concurrent_requests: int | None = None,
    served_model_name: str = "test-model",
    limits: HTTPLimits | None = None,
    rebuild: Callable[[], EngineClient] | None = None,
    stream_stall_timeout: float | None = 30.0,
    images: ImageFront | None = None,
) -> Iterator[RunningServer]:
    """Run the app over `engine` with uvicorn in a background thread until the block exits (`rebuild`: what
    --on-engine-failure restart replaces a failed engine with; `images`: the image processor and media policy)."""
    client: EngineClient = engine  # mypy proves the fake satisfies the Protocol
    llm = AsyncLLM(
        client,
        ServingConfig(
            served_model_name=served_model_name,
            max_waiting_requests=max_waiting_requests,
            max_concurrent_requests=max_concurrent_requests,
            stream_stall_timeout=stream_stall_timeout,
        ),
        rebuild=rebuild,
    )
    app = build_app(llm, settings, images=images)
    port = free_port()
    config = HTTPConfig(
        app, limits or HTTPLimits(), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", llm, engine)
    finally:
        server.should_exit = True
        thread.join(30)
