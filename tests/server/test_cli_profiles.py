"""`--scheduling-profile`, `--slo-ttft-ms` and `--slo-tpot-ms`: they reach the scheduler section; bad values
exit 2 naming the flag before any model loads."""

from __future__ import annotations

import pytest
from pagoda.server.cli import build_parser, engine_config, main
from pagoda.server.config import EngineConfig


def test_profile_and_slo_flags_map_onto_engine_config() -> None:
    """The flags set the scheduler section's fields; per-class targets parse into the canonical tuple."""
    flags = ["--scheduling-profile", "adaptive", "--slo-ttft-ms", "2000,0:300", "--slo-tpot-ms", "80"]
    args = build_parser().parse_args(["serve", "some/model", *flags])
    config = engine_config(args)
    assert config == EngineConfig.from_flat(
        model="some/model", scheduling_profile="adaptive", slo_ttft_ms={None: 2000, 0: 300}, slo_tpot_ms=80
    )
    section = config.scheduler_config
    assert section.slo_ttft_ms == ((None, 2000.0), (0, 300.0)) and section.slo_tpot_ms == ((None, 80.0),)
    default = engine_config(build_parser().parse_args(["serve"])).scheduler_config
    assert default.scheduling_profile is None and default.slo_ttft_ms == () == default.slo_tpot_ms


@pytest.mark.parametrize("profile", ["fast", "default", ""])
def test_an_unknown_profile_exits_2_naming_the_flag(profile: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's choices: status 2, the flag named."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--scheduling-profile", profile])
    assert info.value.code == 2
    assert "--scheduling-profile" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--slo-ttft-ms", "-5"], "--slo-ttft-ms"),
        (["--slo-ttft-ms", "0"], "--slo-ttft-ms"),
        (["--slo-tpot-ms", "fast"], "--slo-tpot-ms"),
        (["--slo-tpot-ms", "100,x:5"], "--slo-tpot-ms"),
        (["--slo-tpot-ms", "100,1:-5"], "--slo-tpot-ms"),
        (["--slo-ttft-ms", "100,1:5,1:6"], "--slo-ttft-ms"),
    ],
)
def test_bad_slos_exit_2_naming_the_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative, zero or non-numeric objective, or a class given twice: exit 2, the flag named."""
    assert main(["serve", "unused-model", *flags]) == 2
    assert named in capsys.readouterr().err
