"""Grammar compilation off the engine step: a thread pool and xgrammar's compiler (with its cache)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from pagoda.server.config import DEFAULT_GRAMMAR_CACHE_BYTES
from pagoda.server.structured.params import StructuredOutputsParams, json_schema_grammar, parse_grammar
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:  # xgrammar takes ~0.4 s to import: loaded at the first constrained request, not at start
    import xgrammar as xgr

# Compiling reads the whole vocabulary per grammar; two threads keep one slow schema from delaying the rest
# without taking every core of a small machine from the engine.
_COMPILE_THREADS = 2


class StructuredOutputManager:
    """Checks constraints, compiles them on background threads (the engine makes one matcher per sample).

    The vocabulary table (`xgr.TokenizerInfo`, seconds for a 262k vocabulary) is built by the first
    compilation, on the pool: an engine that never sees a constrained request never pays for it. The compiler
    caches compiled grammars by their source, so a schema sent again compiles once; the cache holds at most
    `cache_limit_bytes` (xgrammar evicts the least recently used beyond it), so many distinct schemas cannot grow
    the process without bound.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_limit_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
    ) -> None:
        self._tokenizer = tokenizer
        self._cache_limit_bytes = cache_limit_bytes
        self._vocab_size = vocab_size  # the model's logits width, often padded past the tokenizer's
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()  # guards the one-time pool build
        self._compiler_lock = (
            threading.Lock()
        )  # guards the one-time compiler build (seconds: not under _lock)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def vocab_size(self) -> int:
        """The width of the logits rows the bitmasks cover."""
        return self._vocab_size

    @property
    def cache_size_bytes(self) -> int:
        """Bytes the compiled-grammar cache holds now (0 before the first compilation)."""
        with self._compiler_lock:
            return 0 if self._compiler is None else int(self._compiler.get_cache_size_bytes())

    def check(self, params: StructuredOutputsParams) -> None:
        """Parse the constraint now (cheap); GrammarError naming the field if it is invalid."""
        parse_grammar(params)

    def compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """Start compiling on the pool; the future holds the compiled grammar (or the compile error)."""
        with self._lock:  # the API's event loop and the engine thread may both be first
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="pagoda-grammar")
            pool = self._pool
        return pool.submit(self._compile, params)

    def shutdown(self) -> None:
        """Stop the compile threads (pending compilations are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        kind, text = params.source()
        if kind == "json":
            return compiler.compile_grammar(json_schema_grammar(text, compact=params.disable_any_whitespace))
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind in ("choice", "grammar"):
            return compiler.compile_grammar(text)
        return compiler.compile_builtin_json_grammar()

    def _get_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr  # at the first compile, not at start (see the imports)

        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=_COMPILE_THREADS, cache_limit_bytes=self._cache_limit_bytes
                )
            return self._compiler
