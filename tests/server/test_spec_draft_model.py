"""The draft_model proposer: a tiny model drafts for another tiny model of the same vocabulary.

Drafts: the target itself (greedy drafts always accepted), or its copy with a noisy LM head
(`make_tiny_draft`: drafts both often accepted and often rejected), or a one-layer model (nearly always
rejected). Greedy output must equal the plain engine's and transformers' token for token; sampled output must
follow transformers' distribution exactly; the draft's own KV pool must come back whole.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import torch
from pagoda.server.cli import build_parser, engine_config, main
from pagoda.server.llm import LLM
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.spec import SpeculativeConfig, parse_speculative_config
from pagoda.server.spec.build import build_speculation
from pagoda.server.spec.policy import DraftPolicy, StepCostModel
from pagoda.server.spec.verify import rejection_sample
from pagoda.server.testing import ARCHS, LiveServer, make_tiny_draft, make_tiny_model
from transformers import AutoModelForCausalLM

MAX_TOKENS = 14
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A step cost that does not grow with the tokens (decode bound), and no margin: the policy always drafts all k.
FLAT = StepCostModel(one_token_s=1.0, per_token_s=0.0)


def random_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny llama, its noisy-head draft, a one-layer llama draft, and a draft of another vocabulary size."""
    root = tmp_path_factory.mktemp("spec-draft")
    target = make_tiny_model("llama", root / "llama")
    return {
        "llama": target,
        "noisy": make_tiny_draft(target, root / "noisy", noise=0.3),
        "one_layer": make_tiny_model("llama", root / "one-layer", num_hidden_layers=1),
        "other_vocab": make_tiny_model("llama", root / "other-vocab", vocab_size=512),
    }


def make_llm(target: Path, draft: Path | None, k: int = 3, **kwargs: Any) -> LLM:
    """An LLM on a tiny model, block size 4, float32 like the reference; drafting all `k` with `draft`."""
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 96, "dtype": "float32"}
    args.update(kwargs)
    if draft is None:
        return LLM(str(target), **args)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    llm = LLM(str(target), speculative_config=config, **args)
    engine = llm.engine
    assert engine.draft is not None and engine.speculate is not None
    # The policy measured at start could back off on a loaded machine: draft all k.
    policy = DraftPolicy(FLAT, k, draft_token_s=0.0, margin=1.0)
    engine.speculate = build_speculation(parse_speculative_config(config), policy, engine.draft.drafter)
    return llm


def tokens(outputs: Sequence[RequestOutput], index: int = 0) -> list[list[int]]:
    """Generated token ids of sample `index` of each output."""
    return [list(o.outputs[index].token_ids) for o in outputs]


def hf_greedy(model_dir: Path, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt alone."""
    model = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    out = model.generate(
        torch.tensor([list(prompt)]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return cast(list[int], out[0, len(prompt) :].tolist())


def assert_pools_back(llm: LLM) -> None:
    """Every block of the target's pool and of the draft's back, every invariant holding."""
    engine = llm.engine
    kv = cast(Any, engine.kv_manager)
    assert kv.num_free_blocks() == kv.num_blocks
    kv.check_invariants()
    engine.scheduler.check_invariants()
    assert engine.draft is not None
    drafter = engine.draft.drafter
    drafter.check_invariants()
    assert drafter.kv.num_free_blocks() == drafter.kv.num_blocks
    assert not drafter.kv.seqs


def assert_drafts_both_ways(llm: LLM) -> None:
    """Drafts were scheduled, some accepted and some rejected."""
    c = llm.engine.counters
    assert c.spec_decode_num_drafts > 0
    assert 0 < c.spec_decode_num_accepted_tokens < c.spec_decode_num_draft_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_own_draft_greedy_is_always_accepted(arch: str, tmp_path: Path) -> None:
    """On every tiny architecture, the model as its own draft: output equals transformers' greedy, and every
    draft is accepted (the draft's argmax is the target's)."""
    model = make_tiny_model(arch, tmp_path / arch)
    prompts = random_prompts((5, 9, 17), seed=0)
    llm = make_llm(model, model, k=3)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    c = llm.engine.counters
    assert c.spec_decode_num_draft_tokens > 0
    assert c.spec_decode_num_accepted_tokens == c.spec_decode_num_draft_tokens
    assert_pools_back(llm)


def test_noisy_draft_greedy_equals_non_speculative(models: dict[str, Path]) -> None:
    """A draft that is often wrong: output still the plain engine's, token for token."""
    prompts = random_prompts((5, 9, 17, 3), seed=1)
    expected = tokens(make_llm(models["llama"], None).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(models["llama"], models["noisy"], k=4)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert_drafts_both_ways(llm)
    assert_pools_back(llm)


def test_drafts_are_the_draft_models_own_greedy_continuation(models: dict[str, Path]) -> None:
    """Each step's drafts are what the draft model alone continues the sequence with: its KV was caught up on
    the accepted tokens and rolled back past the rejected drafts, under preemption too."""
    prompts = random_prompts((5, 9, 17, 3, 11), seed=2)
    llm = make_llm(models["llama"], models["noisy"], k=3, num_kv_blocks=20, max_model_len=40)
    scheduler = llm.engine.scheduler
    proposals: list[tuple[list[int], tuple[int, ...]]] = []
    propose = scheduler.set_draft_token_ids

    def record(seq_id: str, token_ids: Sequence[int]) -> None:
        request = scheduler.get_request(seq_id)
        if request is not None and token_ids:
            proposals.append((list(request.all_token_ids), tuple(token_ids)))
        propose(seq_id, token_ids)

    scheduler.set_draft_token_ids = record  # type: ignore[method-assign]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert scheduler.stats().num_preemptions > 0
    assert_drafts_both_ways(llm)
    assert len(proposals) > 20
    alone = make_llm(models["noisy"], None)
    params = [SamplingParams(temperature=0.0, max_tokens=len(d), ignore_eos=True) for _, d in proposals]
    want = tokens(alone.generate([s for s, _ in proposals], params, use_tqdm=False))
    assert [list(d) for _, d in proposals] == want


def test_no_drafts_past_the_drafts_context(models: dict[str, Path], tmp_path: Path) -> None:
    """A draft of a shorter context (max_position_embeddings 20): drafts stop where they would pass it; the
    output stays the plain engine's."""
    draft = make_tiny_model("llama", tmp_path / "short", max_position_embeddings=20)
    prompts = random_prompts((5, 9), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = tokens(make_llm(models["llama"], None).generate(prompts, params, use_tqdm=False))
    llm = make_llm(models["llama"], draft, k=3)
    scheduler = llm.engine.scheduler
    ends: list[int] = []
    propose = scheduler.set_draft_token_ids

    def record(seq_id: str, token_ids: Sequence[int]) -> None:
        request = scheduler.get_request(seq_id)
        if request is not None and token_ids:
            ends.append(request.num_tokens + len(token_ids))
        propose(seq_id, token_ids)

    scheduler.set_draft_token_ids = record  # type: ignore[method-assign]
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert ends and max(ends) == 20  # drafted up to the draft's last position, never past it
    assert_pools_back(llm)


def test_chunked_prefill_and_prefix_caching(models: dict[str, Path]) -> None:
    """Small step budget (prompts chunked, drafts cut to the budget) and shared prefixes hitting the cache."""
    shared = random_prompts((16,), seed=4)[0]
    prompts = [shared + tail for tail in random_prompts((3, 6, 9), seed=5)] + random_prompts((21,), seed=6)
    expected = tokens(make_llm(models["llama"], None).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(
        models["llama"], models["noisy"], k=4, max_num_batched_tokens=8, long_prefill_token_threshold=6
    )
    assert tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]
    assert tokens(llm.generate(prompts[1:], GREEDY, use_tqdm=False)) == expected[1:]
    assert llm.engine.scheduler.stats().prefix_cache_hits > 0
    assert_drafts_both_ways(llm)
    assert_pools_back(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_frees_and_rebuilds_the_draft_kv(mode: str, models: dict[str, Path]) -> None:
    """A pool too small for the batch: requests are preempted between drafted steps; output unchanged."""
    prompts = random_prompts((20, 22, 18, 25, 21, 19), seed=8)
    expected = tokens(make_llm(models["llama"], None).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(
        models["llama"],
        models["noisy"],
        k=3,
        num_kv_blocks=24,
        max_model_len=40,
        preemption_mode=mode,
        swap_space_gib=0.01,
    )
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert_drafts_both_ways(llm)
    assert_pools_back(llm)


def test_parallel_samples_draft_each(models: dict[str, Path]) -> None:
    """n = 2 greedy: both samples equal the one greedy continuation, each with its own draft KV."""
    prompt = random_prompts((7,), seed=10)[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    (expected,) = tokens(make_llm(models["llama"], None).generate([prompt], GREEDY, use_tqdm=False))
    llm = make_llm(models["llama"], models["noisy"], k=4)
    out = llm.generate([prompt], params, use_tqdm=False)
    assert tokens(out, 0) == tokens(out, 1) == [expected]
    assert_drafts_both_ways(llm)
    assert_pools_back(llm)


def test_stops_inside_an_accepted_run(models: dict[str, Path]) -> None:
    """The model as its own draft, 5 drafts a step: max_tokens, a stop token and a stop string land inside an
    accepted run; the output ends exactly where the plain engine's does."""
    model = models["llama"]
    prompt = random_prompts((6,), seed=12)[0]
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    base = make_llm(model, None)
    (free,) = tokens(base.generate([prompt], long, use_tqdm=False))
    stop_token = free[11]
    llm = make_llm(model, model, k=5)
    text = str(llm.tokenizer.decode(free[:20]))
    stop_string = text[len(str(llm.tokenizer.decode(free[:9]))) :][:3]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop_token,)),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop_string,)),
    ]
    for params in cases:
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert len(llm.generate([prompt], cases[0], use_tqdm=False)[0].outputs[0].token_ids) == 9
    assert (
        len(llm.generate([prompt], cases[1], use_tqdm=False)[0].outputs[0].token_ids)
        == free.index(stop_token) + 1
    )
    c = llm.engine.counters
    assert c.spec_decode_num_draft_tokens > 0
    assert c.spec_decode_num_accepted_tokens == c.spec_decode_num_draft_tokens
    assert_pools_back(llm)


def test_rejection_storm_returns_every_block(models: dict[str, Path]) -> None:
    """A one-layer draft that is (nearly) always wrong, 7 drafts a step across block boundaries: after every
    step the draft's KV holds exactly its cached tokens; at the end both pools are whole again."""
    prompts = random_prompts((5, 9, 14, 3, 22, 7), seed=15)
    expected = tokens(make_llm(models["llama"], None).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(models["llama"], models["one_layer"], k=7, num_kv_blocks=64)
    engine = llm.engine
    assert engine.draft is not None
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        engine.draft.drafter.check_invariants()
        cast(Any, engine.kv_manager).check_invariants()
    assert [done[str(i)] for i in range(len(prompts))] == expected
    c = engine.counters
    assert c.spec_decode_num_draft_tokens > 100
    assert c.spec_decode_num_accepted_tokens < c.spec_decode_num_draft_tokens / 10
    assert_pools_back(llm)


def test_abort_frees_the_draft_kv(models: dict[str, Path]) -> None:
    """A request aborted mid-decode gives its draft blocks back at once."""
    llm = make_llm(models["llama"], models["noisy"], k=3)
    engine = llm.engine
    assert engine.draft is not None
    drafter = engine.draft.drafter
    engine.add_request("a", random_prompts((10,), seed=30)[0], GREEDY)
    for _ in range(3):
        engine.step()
    assert drafter.kv.num_free_blocks() < drafter.kv.num_blocks  # it holds draft KV now
    engine.abort_request("a")
    assert drafter.kv.num_free_blocks() == drafter.kv.num_blocks
    engine.step()
    assert_pools_back(llm)


def test_sampled_own_draft_is_always_accepted(models: dict[str, Path]) -> None:
    """Sampled rows are verified against the draft's q: with q = p (the model as its own draft, under the
    row's temperature and top_k) min(1, p/q) = 1 accepts every draft; a point-mass test would accept each
    with probability p(draft) only."""
    model = models["llama"]
    llm = make_llm(model, model, k=3)
    params = [
        SamplingParams(temperature=1.0, top_k=8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=s)
        for s in range(4)
    ]
    llm.generate(random_prompts((5, 9, 17, 3), seed=40), params, use_tqdm=False)
    c = llm.engine.counters
    assert c.spec_decode_num_draft_tokens > 20
    assert c.spec_decode_num_accepted_tokens == c.spec_decode_num_draft_tokens
    assert_pools_back(llm)


def test_seeded_sampling_is_deterministic_whatever_the_batch(models: dict[str, Path]) -> None:
    """A seeded request's drafted sampled tokens are the same alone as in a batch."""
    prompts = random_prompts((6, 10, 4), seed=16)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, seed=s)
        for s in (1, 2, 3)
    ]
    llm = make_llm(models["llama"], models["noisy"], k=3)
    together = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert tokens(llm.generate(prompts[1:2], params[1:2], use_tqdm=False)) == together[1:2]
    assert_drafts_both_ways(llm)
    assert_pools_back(llm)


# ------------------------------------------------------------------ distribution


def _p_value(statistic: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (the regularized upper incomplete gamma function)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def test_rejection_sample_keeps_p() -> None:
    """The first output token of rejection sampling against any q is distributed as p (chi-square), and a draft
    is accepted with probability sum(min(p, q))."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.2] * 5])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3]])
    draws = 4000
    counts = [0] * 5
    accepted = 0
    g = torch.Generator().manual_seed(0)
    for n in range(draws):
        draft = int(torch.multinomial(q[0], 1, generator=g))
        out = rejection_sample(p, q, [draft], [n * 7919 + 1, n * 7919 + 2], [4, 4])
        counts[out[0]] += 1
        accepted += out[0] == draft
    assert counts[4] == 0  # p(4) = 0: never output, though q drafts it often
    expected = p[0, :4].double() * draws
    statistic = float(((torch.tensor(counts[:4], dtype=torch.float64) - expected) ** 2 / expected).sum())
    assert _p_value(statistic, 3) > 1e-3, (counts, expected.tolist())
    overlap = float(torch.minimum(p[0], q[0]).sum())  # 0.1 + 0.1 + 0.2 + 0.1 = 0.5
    assert abs(accepted / draws - overlap) < 0.05


TOP_K = 4
DRAWS = 2000
PROMPT = [17, 93, 41, 250, 8, 120]


def _top_k_probs(model: Any, context: Sequence[int]) -> dict[int, float]:
    """transformers' next-token distribution after `context`, cut to the top k and renormalised (T = 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(context)])).logits[0, -1].double()
    top = torch.topk(logits, TOP_K)
    return dict(zip(top.indices.tolist(), torch.softmax(top.values, dim=0).tolist(), strict=True))


def test_drafted_samples_follow_the_exact_distribution(models: dict[str, Path]) -> None:
    """(t0, t1, t2) of 2,000 seeded requests with the noisy draft drafting t1 and t2 (accept with
    min(1, p/q), else the residual), against transformers' p(t0) p(t1 | t0) p(t2 | t0, t1): chi-square
    p-value > 1e-3 over the 64 cells, with drafts both often accepted and often rejected."""
    hf = cast(Any, AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32))
    first = _top_k_probs(hf, PROMPT)
    second = {t0: _top_k_probs(hf, [*PROMPT, t0]) for t0 in first}
    third = {(t0, t1): _top_k_probs(hf, [*PROMPT, t0, t1]) for t0 in first for t1 in second[t0]}
    llm = make_llm(models["llama"], models["noisy"], k=2, num_kv_blocks=1024, max_model_len=32)
    params = [
        SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True, seed=seed)
        for seed in range(DRAWS)
    ]
    counts: dict[tuple[int, ...], int] = {}
    for out in llm.generate([PROMPT] * DRAWS, params, use_tqdm=False):
        cell = tuple(out.outputs[0].token_ids)
        counts[cell] = counts.get(cell, 0) + 1
    cells = [(t0, t1, t2) for t0 in first for t1 in second[t0] for t2 in third[t0, t1]]
    assert set(counts) <= set(cells), "a token outside the top k was drawn"
    probs = [first[t0] * second[t0][t1] * third[t0, t1][t2] for t0, t1, t2 in cells]
    expected = torch.tensor(probs, dtype=torch.float64) * DRAWS
    observed = torch.tensor([counts.get(cell, 0) for cell in cells], dtype=torch.float64)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert _p_value(statistic, len(cells) - 1) > 1e-3, (statistic, observed.tolist(), expected.tolist())
    c = llm.engine.counters
    drafted, accepted = c.spec_decode_num_draft_tokens, c.spec_decode_num_accepted_tokens
    assert drafted >= DRAWS  # every request drafted after its first token
    assert drafted * 0.15 < accepted < drafted * 0.85, (drafted, accepted)  # both outcomes are frequent
    assert_pools_back(llm)


# ------------------------------------------------------------------ configuration


def _serve_exit(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `pagoda serve` with `args`: it must exit 2; its stderr."""
    with pytest.raises(SystemExit) as info:
        code = main(["serve", *args])
        raise SystemExit(code)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_draft_of_another_vocabulary_exits_2(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A draft whose vocabulary size differs: exit 2 naming the key 'model', before any weight is loaded."""
    config = json.dumps({"method": "draft_model", "model": str(models["other_vocab"])})
    err = _serve_exit([str(models["llama"]), "--speculative-config", config], capsys)
    assert "'model'" in err and "vocabulary" in err


def test_draft_of_another_tokenizer_exits_2(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same vocabulary size, another tokenizer (two tokens swapped): exit 2 naming the key 'model'."""
    draft = make_tiny_draft(models["llama"], tmp_path / "swapped", noise=0.0)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.__getitem__)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.dumps({"method": "draft_model", "model": str(draft)})
    err = _serve_exit([str(models["llama"]), "--speculative-config", config], capsys)
    assert "'model'" in err and "tokenizer" in err


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"method": "draft_model"}, "'model'"),
        ({"method": "draft_model", "model": "/no/such/draft"}, "'model'"),
        (
            {"method": "draft_model", "model": "{llama}", "draft_tensor_parallel_size": 2},
            "'draft_tensor_parallel_size'",
        ),
        (
            {"method": "draft_model", "model": "{llama}", "num_speculative_tokens": 0},
            "'num_speculative_tokens'",
        ),
    ],
)
def test_bad_draft_config_exits_2(
    config: dict[str, object], key: str, models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing or absent draft path, a split draft, k < 1: exit 2 naming the key."""
    text = json.dumps(config).replace("{llama}", str(models["llama"]))
    err = _serve_exit([str(models["llama"]), "--speculative-config", text], capsys)
    assert "--speculative-config" in err and key in err


def test_offline_llm_refuses_another_vocabulary(models: dict[str, Path]) -> None:
    """LLM(speculative_config=...) takes the same keys and refuses the same drafts, naming 'model'."""
    config = {"method": "draft_model", "model": str(models["other_vocab"])}
    with pytest.raises(ValueError, match="'model'"):
        LLM(str(models["llama"]), speculative_config=config, block_size=4, num_kv_blocks=64, max_model_len=32)


def test_policy_prices_the_draft() -> None:
    """A draft model's step time makes drafting cost more: fewer drafts, none when a draft costs a target step."""
    costs = StepCostModel(one_token_s=0.010, per_token_s=0.0001)
    free = DraftPolicy(costs, 5).num_drafts(batch_size=1, acceptance=0.6)
    cheap = DraftPolicy(costs, 5, draft_token_s=0.001).num_drafts(batch_size=1, acceptance=0.6)
    dear = DraftPolicy(costs, 5, draft_token_s=0.010).num_drafts(batch_size=1, acceptance=0.6)
    assert free == 5 and 0 < cheap <= free and dear == 0


def test_flag_maps_onto_the_engine_config(models: dict[str, Path]) -> None:
    """vLLM's keys of draft_model reach the engine config."""
    value = {"method": "draft_model", "model": str(models["noisy"]), "num_speculative_tokens": 3}
    args = build_parser().parse_args(["serve", "m", "--speculative-config", json.dumps(value)])
    want = SpeculativeConfig("draft_model", 3, model=str(models["noisy"]))
    assert engine_config(args).speculative_config == want


def test_server_serves_with_a_draft_model(models: dict[str, Path]) -> None:
    """`pagoda serve --speculative-config` with a draft model starts (its vocabulary checked) and answers as the
    plain engine does."""
    prompt = random_prompts((8,), seed=50)[0]
    want = make_llm(models["llama"], None).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].text
    config = json.dumps({"method": "draft_model", "model": str(models["noisy"]), "num_speculative_tokens": 3})
    flags = [
        "--dtype",
        "float32",
        "--block-size",
        "4",
        "--max-model-len",
        "96",
        "--speculative-config",
        config,
    ]
    with LiveServer(models["llama"], flags, served_model_name="m") as server:
        body = {
            "model": "m",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == want


@pytest.mark.timeout(300)
def test_tp2_target_with_an_unsplit_draft(tmp_path: Path) -> None:
    """A TP=2 target drafted by a draft model on the driver (unsplit): TP=1's greedy tokens, exactly."""
    model = make_tiny_model("llama", tmp_path / "llama", num_key_value_heads=4)
    draft = make_tiny_draft(model, tmp_path / "noisy", noise=0.3)
    prompts = random_prompts((5, 9, 17), seed=30)
    expected = tokens(make_llm(model, None).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(model, draft, k=3, tensor_parallel_size=2)
    try:
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert_drafts_both_ways(llm)
        assert_pools_back(llm)
    finally:
        llm.engine.close()
