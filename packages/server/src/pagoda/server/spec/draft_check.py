"""`check_draft_vocabulary`: a draft model must share the target's vocabulary (size and tokenizer).

Run before the engine loads anything (`pagoda serve` exits 2 on it), and again when the engine loads the draft.
Only configs and tokenizers are read here: no weights.
"""

from __future__ import annotations

from pathlib import Path

from pagoda.server.loader import resolve_model_folder, resolve_tokenizer_folder
from transformers import AutoConfig, AutoTokenizer


def _vocabulary(folder: Path, tokenizer: Path | None = None) -> tuple[int, dict[str, int]]:
    """A model folder's vocabulary size (its config's) and its tokenizer's token -> id map."""
    config = AutoConfig.from_pretrained(folder).get_text_config()
    vocab = AutoTokenizer.from_pretrained(tokenizer or folder).get_vocab()
    return int(config.vocab_size), dict(vocab)


def check_draft_vocabulary(
    target: str | None, draft: str, *, tokenizer: str | None = None, cache_dir: Path | None = None
) -> None:
    """ValueError naming the key 'model' when the draft's vocabulary size or tokenizer differs from the target's
    (the target's tokenizer is `tokenizer` when given, as the engine loads it)."""
    target_folder = resolve_model_folder(target, cache_dir)
    draft_folder = resolve_model_folder(draft, cache_dir)
    target_size, target_vocab = _vocabulary(
        target_folder, None if tokenizer is None else resolve_tokenizer_folder(tokenizer)
    )
    draft_size, draft_vocab = _vocabulary(draft_folder)
    if draft_size != target_size:
        raise ValueError(
            f"speculative_config key 'model': the draft model {draft!r} has a vocabulary of {draft_size} "
            f"tokens, the target's has {target_size}; a draft must share the target's vocabulary"
        )
    if draft_vocab != target_vocab:
        differ = sum(1 for token, i in draft_vocab.items() if target_vocab.get(token) != i)
        raise ValueError(
            f"speculative_config key 'model': the draft model {draft!r} has another tokenizer than the target "
            f"({differ} of its {len(draft_vocab)} tokens map to other ids); a draft must share the tokenizer"
        )
