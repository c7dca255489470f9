"""Helpers for the tests, tools and benchmarks of the server; the server itself imports none of them.

`tiny_models`: tiny random-weight Hugging Face models of every supported architecture (`make_tiny_model`, their
transformers `tiny_config` and `make_tiny_hf_model`) and the tiny tokenizer they share (`make_tiny_tokenizer`).
`paged_kv`: `PagedKV`, a paged KV cache that runs a `CausalLM` step by step without the engine. `serve`:
`LiveServer`, `pagoda serve` in a subprocess returned once /health answers 200 (`ServerStartError`, with the
server's output, when it exits first or times out), and `free_port`. `dense_copy`: a float32 copy of a converted
model folder whose weights stay in GGUF block formats, for transformers to load as the reference. `tiny_lora`
(needs `peft`): tiny random PEFT adapters (`make_tiny_lora`) and their transformers + PEFT reference.
`tiny_draft`: `make_tiny_draft`, a tiny model's copy with a noisy LM head, as its speculative draft model.
`tiny_classifier`: tiny random cross-encoders (`make_tiny_classifier`, `*ForSequenceClassification` of the Llama,
Qwen2 and Qwen3 configs) and their transformers reference (`make_tiny_hf_classifier`). `tiny_vlm`: tiny random
vision-language models (`make_tiny_vlm`: Llava and Gemma 3 folders with processor configs) and their transformers
reference (`make_tiny_hf_vlm`). `compare`: `assert_same_logprobs`, two engines' tokens and logprobs side by side.
"""

from pagoda.server.testing.dense_copy import dense_copy
from pagoda.server.testing.paged_kv import PagedKV, Step
from pagoda.server.testing.serve import LiveServer, ServerStartError, free_port, serve_command
from pagoda.server.testing.tiny_classifier import (
    CLASSIFIER_ARCHS,
    make_tiny_classifier,
    make_tiny_hf_classifier,
)
from pagoda.server.testing.tiny_draft import make_tiny_draft
from pagoda.server.testing.tiny_models import (
    ARCHS,
    BOS,
    CHAT_TEMPLATE,
    EOS,
    MODEL_VOCAB_SIZE,
    PAD,
    SLIDING_WINDOW,
    VOCAB_SIZE,
    make_tiny_hf_model,
    make_tiny_model,
    make_tiny_tokenizer,
    tiny_config,
)

__all__ = [
    "ARCHS",
    "BOS",
    "CHAT_TEMPLATE",
    "CLASSIFIER_ARCHS",
    "EOS",
    "MODEL_VOCAB_SIZE",
    "PAD",
    "SLIDING_WINDOW",
    "VOCAB_SIZE",
    "LiveServer",
    "PagedKV",
    "ServerStartError",
    "Step",
    "dense_copy",
    "free_port",
    "make_tiny_classifier",
    "make_tiny_draft",
    "make_tiny_hf_classifier",
    "make_tiny_hf_model",
    "make_tiny_model",
    "make_tiny_tokenizer",
    "serve_command",
    "tiny_config",
]
