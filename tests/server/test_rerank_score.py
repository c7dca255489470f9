"""Issue 42 (rerank and score): sequence-classification models (cross-encoders) on the pooling runner, offline
(`LLM.score`, `LLM.rerank`) and through `pagoda serve --runner pooling` (POST /score, /rerank and their aliases),
against transformers' `model(**tokenizer(text_1, text_2, return_tensors="pt")).logits`; the pairing rules, the
cosine path of an embedding model, and the 400s.

Tolerance: scores must equal transformers' float32 output within TOL = 1e-4 (absolute, relative beyond 1). Both
sides compute the same float32 operations in different orders (paged attention, oneDNN matmuls, fused norms), so
they differ by rounding only: a float32 dot product of length n is off by at most about n * u * sum|a_i b_i|
(u = 2^-24 ~ 6e-8; Higham's bound), 7.6e-6 relative for the longest here (n = 128, the MLP's down projection).
The tiny models chain about ten such products (two layers of qkv, attention, o, gate/up, down, then the head),
whose RMS norms keep the activations O(1), so the logit (O(1)) is off by at most ~10 x 7.6e-6 ~ 8e-5 < TOL, and
a sigmoid (slope <= 1/4) only shrinks that. Measured on the three tiny models (10 pairs each): at most
8.3e-7 on the sigmoid and 4.5e-6 on the raw logit (|logit| up to 2.9).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import torch
from api_cases import MAX_MODEL_LEN, MODEL
from api_fake_engine import FakeEngine, serve_in_thread
from pagoda.server.cli import build_parser, engine_config, main
from pagoda.server.engine import RequestRejectedError
from pagoda.server.engine.setup import EngineConfigError
from pagoda.server.llm import LLM
from pagoda.server.pooling.classifier import ClassifierConfigError
from pagoda.server.pooling.scoring import ScoreInputError, cosine, pair_up, ranking
from pagoda.server.testing import CLASSIFIER_ARCHS, PAD, make_tiny_classifier
from test_api_live import LiveServer, serving
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

TOL = 1e-4
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris",
    "The capital of Italy is Rome.",
    "A paged cache splits every sequence into fixed blocks of tokens, and blocks are shared.",
    f"Paris{PAD}",  # ends in the pad id: transformers reads the row of the last token that is not pad
    "Hello world! How are you today?",
]
# Without the pad twin of "Paris" (an exact tie in transformers, whose order rounding would decide).
RANKED = [doc for doc in DOCUMENTS if not doc.endswith(PAD)]


def reference_logits(model_dir: Path, pairs: Sequence[tuple[str, str]]) -> list[float]:
    """transformers' float32 logit of each pair, encoded as `tokenizer(text_1, text_2)`."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = cast(Any, AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32))
    with torch.no_grad():
        return [float(model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0]) for a, b in pairs]


def sigmoid(values: Sequence[float]) -> list[float]:
    """The sigmoid of each value (float32, as the references are)."""
    return [float(torch.sigmoid(torch.tensor(v))) for v in values]


def assert_scores(got: Sequence[float], want: Sequence[float]) -> None:
    """Each score within TOL of its reference (relative beyond magnitude 1)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= TOL * max(1.0, abs(w)), f"pair {i}: {g} vs transformers' {w}"


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random cross-encoder (num_labels 1) of each architecture."""
    root = tmp_path_factory.mktemp("cross-encoders")
    return {arch: make_tiny_classifier(arch, root / arch) for arch in CLASSIFIER_ARCHS}


def score_llm(model_dir: Path) -> LLM:
    """A float32 pooling LLM with 16-token steps (longer pairs are prefilled in chunks) and 4-token blocks."""
    return LLM(
        str(model_dir),
        runner="pooling",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=128,
        kv_cache_gib=0.01,
    )


# ---------------------------------------------------------------------------------------------------- offline


@pytest.mark.parametrize("arch", CLASSIFIER_ARCHS)
def test_offline_scores_equal_transformers(classifiers: dict[str, Path], arch: str) -> None:
    """`LLM.score` of a query against a list equals transformers' sigmoid(logit) (use_activation=False: the raw
    logit), chunked and batched; a repeat is served by the prefix cache with the same scores, except the pair
    that ends in pad, whose row lies before its last position and so never comes from the cache."""
    model_dir = classifiers[arch]
    pairs = [(QUERY, doc) for doc in DOCUMENTS]
    logits = reference_logits(model_dir, pairs)
    llm = score_llm(model_dir)
    first = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert_scores([out.outputs.score for out in first], sigmoid(logits))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert [list(out.prompt_token_ids) for out in first] == [tokenizer(a, b)["input_ids"] for a, b in pairs]
    again = llm.score(QUERY, DOCUMENTS, use_activation=False, use_tqdm=False)
    assert_scores([out.outputs.score for out in again], logits)
    cached = [out.num_cached_tokens for out in again]
    assert cached[3] == 0 and all(n > 0 for i, n in enumerate(cached) if i != 3), cached
    # The pad rule is what makes pair 3 right: its last token's row scores differently.
    assert abs(first[3].outputs.score - first[0].outputs.score) <= TOL
    model = cast(Any, AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32))
    with torch.no_grad():
        hidden = model.model(**tokenizer(*pairs[3], return_tensors="pt")).last_hidden_state[0, -1]
        assert abs(float(model.score(hidden)[0]) - logits[3]) > 100 * TOL


def test_offline_rerank_and_pairing(classifiers: dict[str, Path]) -> None:
    """`LLM.rerank` sorts by score and cuts at top_n; `LLM.score` pairs lists item by item and a list of one with
    every item, and refuses lists of different lengths naming the argument."""
    model_dir = classifiers["llama"]
    llm = score_llm(model_dir)
    want = sigmoid(reference_logits(model_dir, [(QUERY, doc) for doc in RANKED]))
    ranked = llm.rerank(QUERY, RANKED, top_n=3, use_tqdm=False)
    assert [r.index for r in ranked] == sorted(range(len(RANKED)), key=lambda i: -want[i])[:3]
    assert [r.document for r in ranked] == [RANKED[r.index] for r in ranked]
    assert_scores([r.score for r in ranked], [want[r.index] for r in ranked])
    texts = ["Rome", "Paris", "blocks"]
    pairwise = llm.score(texts, list(reversed(texts)), use_tqdm=False)
    assert_scores(
        [out.outputs.score for out in pairwise],
        sigmoid(reference_logits(model_dir, list(zip(texts, reversed(texts), strict=True)))),
    )
    one = llm.score([QUERY], RANKED[:2], use_tqdm=False)
    assert_scores([out.outputs.score for out in one], want[:2])
    with pytest.raises(ScoreInputError) as info:
        llm.score(texts, texts[:2], use_tqdm=False)
    assert info.value.param == "text_2"


def test_regression_head_is_the_raw_logit(tmp_path: Path) -> None:
    """problem_type "regression": the score is the head's raw output (no sigmoid), as transformers reads it."""
    model_dir = make_tiny_classifier("qwen2", tmp_path / "regression", problem_type="regression")
    logits = reference_logits(model_dir, [(QUERY, doc) for doc in DOCUMENTS])
    assert max(abs(v - s) for v, s in zip(logits, sigmoid(logits), strict=True)) > 0.1  # a sigmoid would show
    scores = score_llm(model_dir).score(QUERY, DOCUMENTS, use_tqdm=False)
    assert_scores([out.outputs.score for out in scores], logits)


def test_sentence_transformers_activation_is_read(tmp_path: Path) -> None:
    """A cross-encoder config naming Identity (sentence-transformers' activation_fn) scores raw logits, as vLLM
    reads it; an activation it cannot apply is refused at start naming the key."""
    model_dir = make_tiny_classifier("llama", tmp_path / "identity")
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    config_file.write_text(json.dumps(config))
    logits = reference_logits(model_dir, [(QUERY, DOCUMENTS[0])])
    assert_scores([score_llm(model_dir).score(QUERY, DOCUMENTS[0], use_tqdm=False)[0].outputs.score], logits)
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Tanh"}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ClassifierConfigError, match="Tanh") as info:
        score_llm(model_dir)
    assert info.value.key == "sentence_transformers.activation_fn"


def test_embedding_model_scores_by_cosine(tiny_model_path: Callable[[str], Path]) -> None:
    """On an embedding model `LLM.score` is the cosine of the two texts' LAST-pooled final hidden states
    (transformers' `last_hidden_state`), and an embedding of a cross-encoder is refused naming the task."""
    model_dir = tiny_model_path("llama")
    llm = score_llm(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    with torch.no_grad():
        vectors = {
            text: model.model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1]
            for text in [QUERY, *DOCUMENTS]
        }
    want = [
        float(torch.nn.functional.cosine_similarity(vectors[QUERY], vectors[d], dim=0)) for d in DOCUMENTS
    ]
    got = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert_scores([out.outputs.score for out in got], want)
    assert list(got[0].prompt_token_ids) == tokenizer.encode(QUERY) + tokenizer.encode(DOCUMENTS[0])


def test_cross_encoder_refuses_embeddings_and_the_generate_runner(classifiers: dict[str, Path]) -> None:
    """A cross-encoder embeds nothing (a rejection naming the input), and cannot start on the generate runner."""
    model_dir = classifiers["qwen3"]
    with pytest.raises(RequestRejectedError, match="cross-encoder") as info:
        score_llm(model_dir).embed("hi", use_tqdm=False)
    assert info.value.param == "input"
    with pytest.raises(EngineConfigError, match="--runner pooling"):
        LLM(str(model_dir), dtype="float32", kv_cache_gib=0.01, max_model_len=128)


def test_cli_names_the_runner(classifiers: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`pagoda serve` of a cross-encoder without --runner pooling exits 2 saying which runner to start, before
    any weight loads; vLLM's older `--task score` selects the pooling runner."""
    for flags in ([], ["--runner", "generate"]):
        assert main(["serve", str(classifiers["llama"]), *flags]) == 2
        assert "--runner pooling" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", str(classifiers["llama"]), "--task", "score"])
    assert engine_config(args).model_config.runner == "pooling"


def test_two_labels_are_refused(tmp_path: Path) -> None:
    """/score needs one relevance logit: a two-label head is refused at start naming num_labels."""
    model_dir = make_tiny_classifier("llama", tmp_path / "two", num_labels=2)
    with pytest.raises(ClassifierConfigError) as info:
        score_llm(model_dir)
    assert info.value.key == "num_labels"


def test_pairing_rules() -> None:
    """A string (or a list of one) pairs with each item of the other side, equal lists item by item; an empty list
    or lists of different lengths are refused naming the field."""
    assert pair_up("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["a", "b"], "q") == [("a", "q"), ("b", "q")]
    assert pair_up(["q"], ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["a", "b"], ["c", "d"]) == [("a", "c"), ("b", "d")]
    assert pair_up("a", "b") == [("a", "b")]
    for first, second, param in ((["a", "b"], ["c"] * 3, "text_2"), ([], "b", "text_1"), ("a", [], "text_2")):
        with pytest.raises(ScoreInputError) as info:
            pair_up(first, second)
        assert info.value.param == param
    assert ranking([0.1, 0.9, 0.5, 0.9], None) == [1, 3, 2, 0]
    assert ranking([0.1, 0.9, 0.5], 2) == [1, 2]
    assert ranking([0.1, 0.9, 0.5], 0) == [1, 2, 0]
    assert cosine([1.0, 0.0], [1.0, 1.0]) == pytest.approx(2**-0.5)
    assert cosine([0.0, 0.0], [1.0, 1.0]) == 0.0


def test_generate_runner_answers_400_naming_the_runner() -> None:
    """/score and /rerank (every alias) on a generate server: a 400 naming the runner to start."""
    with serve_in_thread(FakeEngine()) as running:
        for path, body in [
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/score", {"text_1": "a", "text_2": ["b", "c"]}),
            ("/rerank", {"query": "q", "documents": ["a"]}),
            ("/v1/rerank", {"query": "q", "documents": ["a"]}),
            ("/v2/rerank", {"query": "q", "documents": ["a"]}),
        ]:
            response = httpx.post(running.base_url + path, json=body, timeout=30)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "model"
            assert "generate runner" in error["message"] and "--runner pooling" in error["message"]


# --------------------------------------------------------------------------------------------------- live server


@pytest.fixture(scope="module")
def live(classifiers: dict[str, Path]) -> Iterator[LiveServer]:
    """`pagoda serve --runner pooling` on the tiny Qwen3 cross-encoder, 8-token steps (chunked prefill)."""
    with serving(
        classifiers["qwen3"],
        "--runner",
        "pooling",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-batched-tokens",
        "8",
    ) as server:
        yield server


def post(live: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a JSON body; its 200 answer."""
    response = httpx.post(live.base_url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_live_score_equals_transformers(live: LiveServer, classifiers: dict[str, Path], path: str) -> None:
    """POST /score: data[{index, object, score}] in pair order, equal to transformers' sigmoid(logit), for a string
    against a list, a list against a string, equal lists and two strings; usage counts every pair's tokens;
    use_activation false gives the raw logits."""
    model_dir = classifiers["qwen3"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cases: list[tuple[Any, Any, list[tuple[str, str]]]] = [
        (QUERY, DOCUMENTS, [(QUERY, d) for d in DOCUMENTS]),
        (DOCUMENTS[:3], QUERY, [(d, QUERY) for d in DOCUMENTS[:3]]),
        (DOCUMENTS[:2], DOCUMENTS[2:4], list(zip(DOCUMENTS[:2], DOCUMENTS[2:4], strict=True))),
        (QUERY, DOCUMENTS[1], [(QUERY, DOCUMENTS[1])]),
    ]
    for text_1, text_2, pairs in cases:
        answer = post(live, path, {"model": MODEL, "text_1": text_1, "text_2": text_2})
        assert answer["object"] == "list" and answer["model"] == MODEL and answer["id"].startswith("score-")
        assert isinstance(answer["created"], int)
        assert [d["index"] for d in answer["data"]] == list(range(len(pairs)))
        assert {d["object"] for d in answer["data"]} == {"score"}
        assert_scores([d["score"] for d in answer["data"]], sigmoid(reference_logits(model_dir, pairs)))
        tokens = sum(len(tokenizer(a, b)["input_ids"]) for a, b in pairs)
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] == tokens
    raw = post(live, path, {"text_1": QUERY, "text_2": DOCUMENTS, "use_activation": False})
    assert_scores(
        [d["score"] for d in raw["data"]], reference_logits(model_dir, [(QUERY, d) for d in DOCUMENTS])
    )


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_live_rerank_sorts_and_cuts(live: LiveServer, classifiers: dict[str, Path], path: str) -> None:
    """POST /rerank: results sorted by relevance_score (transformers' scores), each with its index and document;
    top_n cuts the list; return_documents false leaves the documents out; documents may be {"text": ...}."""
    want = sigmoid(reference_logits(classifiers["qwen3"], [(QUERY, d) for d in RANKED]))
    order = sorted(range(len(RANKED)), key=lambda i: -want[i])
    answer = post(live, path, {"model": MODEL, "query": QUERY, "documents": RANKED})
    assert answer["model"] == MODEL and answer["id"].startswith("rerank-")
    results = answer["results"]
    assert [r["index"] for r in results] == order
    assert [r["document"]["text"] for r in results] == [RANKED[i] for i in order]
    assert_scores([r["relevance_score"] for r in results], [want[i] for i in order])
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
    top = post(
        live,
        path,
        {
            "query": QUERY,
            "documents": [{"text": d} for d in RANKED],
            "top_n": 2,
            "return_documents": False,
        },
    )
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all("document" not in r for r in top["results"])
    everything = post(live, path, {"query": QUERY, "documents": RANKED, "top_n": 0})
    assert len(everything["results"]) == len(RANKED)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_2": "x"}, "text_1"),
        ("/score", {"text_1": 5, "text_2": "x"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/score", {"text_1": [], "text_2": "b"}, "text_1"),
        ("/score", {"text_1": ["a", "b", "c"], "text_2": ["x", "y"]}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "word " * 200}, "text_2"),
        ("/score", {"text_1": "a", "text_2": ["x"] * 10_000}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "b", "use_activation": "no"}, "use_activation"),
        ("/score", {"text_1": "a", "text_2": "b", "temperature": 0}, "temperature"),
        ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model"),
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": "a"}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": [1]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": [{"txt": "a"}]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 5}, "max_tokens_per_doc"),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "model": "other"}, "model"),
    ],
)
def test_live_bad_fields_are_4xx_naming_them(
    live: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    """Each bad body is a 400 naming its field (404 for another model), and the server scores on."""
    response = httpx.post(live.base_url + path, json=body, timeout=60)
    assert response.status_code == (404 if param == "model" else 400), response.text
    assert response.json()["error"]["param"] == param, response.text
    assert len(post(live, "/score", {"text_1": "still", "text_2": ["serving"]})["data"]) == 1


def test_live_cross_encoder_serves_no_embeddings_or_completions(live: LiveServer) -> None:
    """/v1/embeddings on a cross-encoder is a 400 naming the input (it scores pairs); a completion is a 400
    naming the generate runner."""
    response = httpx.post(f"{live.base_url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "input"
    assert "cross-encoder" in response.json()["error"]["message"]
    response = httpx.post(
        f"{live.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert "--runner generate" in response.json()["error"]["message"]
