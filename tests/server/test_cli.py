"""`pagoda serve` argument handling: flags map onto EngineConfig, bad values and a too-small KV cache refuse."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pagoda.server.cli import build_parser, engine_config, main
from pagoda.server.cli_args import parse_replica_cpus, serve_config
from pagoda.server.config import DEFAULT_MAX_WAITING_REQUESTS, EngineConfig
from pagoda.server.llm import LLM
from pagoda.server.testing import make_tiny_model


def test_defaults_match_engine_config_defaults() -> None:
    """Without flags the engine gets EngineConfig's own defaults, the default model and vLLM's host/port."""
    args = build_parser().parse_args(["serve"])
    assert engine_config(args) == EngineConfig()
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    # A finite default (issue 28): beyond it a 429, as with the flag given.
    assert args.max_waiting_requests == DEFAULT_MAX_WAITING_REQUESTS == 4096
    assert args.stream_stall_timeout == 30.0


def test_flags_map_onto_engine_config() -> None:
    """Every engine flag lands in the matching EngineConfig field."""
    args = build_parser().parse_args(
        [
            "serve",
            "some/model",
            "--max-model-len",
            "512",
            "--max-num-batched-tokens",
            "1024",
            "--max-num-seqs",
            "8",
            "--block-size",
            "32",
            "--gpu-memory-utilization",
            "0.5",
            "--kv-cache-gib",
            "1.5",
            "--swap-space",
            "2",
            "--no-enable-prefix-caching",
            "--preemption-mode",
            "swap",
            "--enforce-eager",
            "--kernel-backend",
            "torch",
            "--dtype",
            "float32",
            "--seed",
            "3",
        ]
    )
    assert engine_config(args) == EngineConfig.from_flat(
        model="some/model",
        max_model_len=512,
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        block_size=32,
        gpu_memory_utilization=0.5,
        kv_cache_gib=1.5,
        swap_space_gib=2.0,
        enable_prefix_caching=False,
        preemption_mode="swap",
        enforce_eager=True,
        kernel_backend="torch",
        dtype="float32",
        seed=3,
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--kernel-backend", "cuda"],
        ["--dtype", "int8"],
        ["--preemption-mode", "never"],
        ["--port", "http"],
    ],
)
def test_invalid_choices_exit_2(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """argparse rejects unknown choices and non-numbers with status 2."""
    with pytest.raises(SystemExit) as info:
        main(["serve", *flags])
    assert info.value.code == 2
    assert "invalid" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-waiting-requests", "-1"], "--max-waiting-requests"),
        (["--max-waiting-requests", "0"], "--max-waiting-requests"),
        (["--max-prompts-per-request", "0"], "--max-prompts-per-request"),
        (["--max-sequences-per-request", "0"], "--max-sequences-per-request"),
        (["--shutdown-timeout", "-2"], "--shutdown-timeout"),
        (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
        (["--port", "70000"], "--port"),
        (["--max-request-head-bytes", "100"], "--max-request-head-bytes"),
        (["--request-head-timeout", "0"], "--request-head-timeout"),
        (["--request-body-timeout", "-1"], "--request-body-timeout"),
        (["--stream-stall-timeout", "0"], "--stream-stall-timeout"),
        (["--block-size", "0"], "block_size"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    ],
)
def test_out_of_range_values_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Out-of-range numbers are refused before any model loads, naming the flag or field."""
    assert main(["serve", "unused-model", *flags]) == 2
    assert message in capsys.readouterr().err


def test_refuses_to_start_when_one_request_cannot_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KV cache smaller than one max_model_len request: a bad flag, exit 2 naming both numbers and what to
    change."""
    model = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=4096)
    status = main(["serve", str(model), "--max-model-len", "4096", "--kv-cache-gib", "0.0001"])
    assert status == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "--kv-cache-gib" in err and "--max-model-len" in err
    longest = re.search(r"at most (\d+) tokens for one sequence", err)
    assert "max_model_len 4096" in err and longest is not None and int(longest.group(1)) < 4096, err


def test_engine_core_process_refuses_a_max_model_len_the_pool_cannot_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same bad flag with the engine in its own process: the core's start-up failure is still exit 2 with
    both numbers (not the exit 1 of a core that crashed)."""
    model = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=4096)
    flags = ["--max-model-len", "4096", "--kv-cache-gib", "0.0001", "--engine-core", "process"]
    status = main(["serve", str(model), *flags])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "max_model_len 4096 does not fit" in err and "at most" in err and "--kv-cache-gib" in err


def test_offline_llm_refuses_a_max_model_len_the_pool_cannot_hold(tmp_path: Path) -> None:
    """The offline LLM raises a ValueError naming both numbers (the CLI's exit-2 case)."""
    model = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=4096)
    with pytest.raises(
        ValueError, match=r"max_model_len 4096 does not fit.*at most \d+ tokens for one sequence"
    ):
        LLM(str(model), max_model_len=4096, kv_cache_gib=0.0001)


def test_tokenizer_flag_maps_onto_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    """`--tokenizer FOLDER` lands in EngineConfig.tokenizer and is documented in --help."""
    args = build_parser().parse_args(["serve", "some/model", "--tokenizer", "some/tokenizer"])
    assert engine_config(args) == EngineConfig.from_flat(model="some/model", tokenizer="some/tokenizer")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--tokenizer" in capsys.readouterr().out


def test_help_lists_the_vllm_flag_names(capsys: pytest.CaptureFixture[str]) -> None:
    """`pagoda serve --help` documents every flag of the issue."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in [
        "--host",
        "--port",
        "--served-model-name",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--max-num-seqs",
        "--block-size",
        "--gpu-memory-utilization",
        "--kv-cache-gib",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--preemption-mode",
        "--enforce-eager",
        "--kernel-backend",
        "--api-key",
        "--max-waiting-requests",
        "--max-prompts-per-request",
        "--max-sequences-per-request",
        "--shutdown-timeout",
        "--dtype",
        "--max-batch-prefill-tokens",
        "--max-total-tokens",
        "--max-input-tokens",
        "--max-input-length",
        "--max-batch-size",
        "--max-concurrent-requests",
        "--enable-chunked-prefill",
        "--long-prefill-token-threshold",
        "--max-num-partial-prefills",
        "--chat-template",
        "--reasoning-parser",
    ]:
        assert flag in text, flag


def test_tgi_flags_map_onto_engine_config() -> None:
    """TGI's names land in the vLLM fields they mean; the chunked-prefill knobs and auto preemption map too."""
    args = build_parser().parse_args(
        [
            "serve",
            "--max-total-tokens",
            "512",
            "--max-batch-size",
            "8",
            "--max-input-length",
            "300",
            "--max-batch-prefill-tokens",
            "1024",
            "--no-enable-chunked-prefill",
            "--long-prefill-token-threshold",
            "64",
            "--max-num-partial-prefills",
            "2",
            "--preemption-mode",
            "auto",
        ]
    )
    assert engine_config(args) == EngineConfig.from_flat(
        max_model_len=512,
        max_num_seqs=8,
        max_input_tokens=300,
        max_batch_prefill_tokens=1024,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=64,
        max_num_partial_prefills=2,
        preemption_mode="auto",
    )
    same = ["serve", "--max-batch-size", "8", "--max-num-seqs", "8", "--max-input-tokens", "9"]
    assert engine_config(build_parser().parse_args(same)) == EngineConfig.from_flat(
        max_num_seqs=8, max_input_tokens=9
    )


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--max-total-tokens", "512", "--max-model-len", "1024"], ("--max-total-tokens", "--max-model-len")),
        (["--max-num-seqs", "256", "--max-batch-size", "8"], ("--max-batch-size", "--max-num-seqs")),
        (
            ["--max-input-length", "10", "--max-input-tokens", "20"],
            ("--max-input-length", "--max-input-tokens"),
        ),
    ],
)
def test_a_tgi_flag_and_its_vllm_twin_must_agree(
    flags: list[str], names: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Both spellings of one limit with different values: exit 2 naming both (even the vLLM default, given)."""
    assert main(["serve", "unused-model", *flags]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in names), err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-concurrent-requests", "0"], "--max-concurrent-requests"),
        (["--max-batch-prefill-tokens", "0"], "max_batch_prefill_tokens"),
        (["--max-num-partial-prefills", "0"], "max_num_partial_prefills"),
        (["--long-prefill-token-threshold", "0"], "long_prefill_token_threshold"),
        (["--max-input-tokens", "0"], "max_input_tokens"),
    ],
)
def test_out_of_range_knobs_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The new knobs refuse non-positive values before any model loads."""
    assert main(["serve", "unused-model", *flags]) == 2
    assert message in capsys.readouterr().err


def test_scheduling_flags_map_onto_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    """--scheduling-policy (fcfs|priority|static), --static-batch-timeout and --kv-manager reach EngineConfig."""
    flags = ["--scheduling-policy", "static", "--static-batch-timeout", "0.5", "--kv-manager", "contiguous"]
    args = build_parser().parse_args(["serve", "some/model", *flags])
    assert engine_config(args) == EngineConfig.from_flat(
        model="some/model", scheduling_policy="static", static_batch_timeout_s=0.5, kv_manager="contiguous"
    )
    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority"])
    assert engine_config(args) == EngineConfig.from_flat(scheduling_policy="priority")
    for bad in (["--scheduling-policy", "lifo"], ["--kv-manager", "slab"]):
        with pytest.raises(SystemExit) as info:
            main(["serve", *bad])
        assert info.value.code == 2
        assert "invalid choice" in capsys.readouterr().err
    assert main(["serve", "unused-model", "--static-batch-timeout", "-1"]) == 2
    assert "static_batch_timeout_s" in capsys.readouterr().err


def test_chat_template_and_reasoning_parser_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--reasoning-parser` takes vLLM's names; a `--chat-template` that is neither a file nor a template exits 2."""
    args = build_parser().parse_args(
        ["serve", "m", "--reasoning-parser", "deepseek_r1", "--chat-template", "x"]
    )
    assert (args.reasoning_parser, args.chat_template) == ("deepseek_r1", "x")
    assert build_parser().parse_args(["serve", "m"]).reasoning_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--reasoning-parser", "granite"])
    assert main(["serve", "unused-model", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_tool_calling_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`--tool-call-parser` takes vLLM's names; `--enable-auto-tool-choice` without it exits 2, as in vLLM."""
    args = build_parser().parse_args(
        ["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "hermes")
    defaults = build_parser().parse_args(["serve", "m"])
    assert (defaults.enable_auto_tool_choice, defaults.tool_call_parser) == (False, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--tool-call-parser", "pythonic"])
    assert main(["serve", "unused-model", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err


def test_tensor_parallel_flags_map_onto_engine_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tensor-parallel-size (-tp) and --distributed-executor-backend reach EngineConfig; a size below 1 or an
    unknown backend exits 2; a size the heads cannot split refuses to start (1) naming the constraint."""
    flags = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    args = build_parser().parse_args(["serve", "some/model", *flags])
    assert engine_config(args) == EngineConfig.from_flat(
        model="some/model", tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    assert (
        engine_config(build_parser().parse_args(["serve", "-tp", "4"])).parallel_config.tensor_parallel_size
        == 4
    )
    assert main(["serve", "unused-model", "--tensor-parallel-size", "0"]) == 2
    assert "tensor_parallel_size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["serve", "--distributed-executor-backend", "slurm"])
    assert info.value.code == 2
    model = make_tiny_model("llama", tmp_path / "llama")
    assert main(["serve", str(model), "--tensor-parallel-size", "3"]) == 1
    assert "tensor_parallel_size 3 must divide num_attention_heads (4)" in capsys.readouterr().err


def test_help_states_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    """No "(default: None)" and no second "(default: ...)" after a help text that states its own default; a flag
    whose help does not state it gets argparse's suffix."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: None)" not in text
    assert "(default: the model's own) (default" not in text
    assert "--enforce-eager CUDA: skip torch.compile (default: False)" in text


def test_replica_cpus_parses_lists_and_ranges() -> None:
    """`--replica-cpus`: one entry per engine core, ';' apart, each CPUs and ranges; it reaches the core config."""
    assert parse_replica_cpus("0;1") == ((0,), (1,))
    assert parse_replica_cpus("0-2;3, 5-6") == ((0, 1, 2), (3, 5, 6))
    one = os.sched_getaffinity(0)
    cpu = min(one)
    args = build_parser().parse_args(
        ["serve", "m", "--data-parallel-size", "2", "--replica-cpus", f"{cpu};{cpu}"]
    )
    assert serve_config(args).core.replica_cpus == ((cpu,), (cpu,))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replica-cpus", "0;x"], "--replica-cpus"),  # not a number
        (["--replica-cpus", "3-1"], "--replica-cpus"),  # a backwards range
        (["--replica-cpus", "0,0"], "--replica-cpus"),  # a CPU twice
        (["--data-parallel-size", "2", "--replica-cpus", "0"], "--replica-cpus"),  # one entry for two cores
        (["--data-parallel-size", "2", "--replica-cpus", "0;"], "--replica-cpus"),  # an empty entry
        (["--data-parallel-size", "2", "--replica-cpus", "0;4096"], "CPU 4096"),  # not this process's
        (["--replica-cpus", "0"], "--replica-cpus"),  # no engine-core process to pin
        (
            ["--engine-core", "process", "--replica-cpus", "0", "--distributed-executor-backend", "ray"],
            "--replica-cpus",
        ),
    ],
)
def test_bad_replica_cpus_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every bad `--replica-cpus` exits 2 naming the flag (or the CPU) before any model loads."""
    try:
        status = main(["serve", "unused-model", *flags])
    except SystemExit as exc:  # argparse's own refusal of the value
        status = exc.code  # type: ignore[assignment]
    assert status == 2
    assert message in capsys.readouterr().err
