"""`python -m pagoda.server.core --log-level N`: one engine-core process; its `CoreSpec` comes on stdin."""

from __future__ import annotations

import argparse
import sys

import msgspec
from pagoda.server.core.engine_core import CoreSpec, run_engine_core


def main() -> None:
    """Read the msgpack `CoreSpec` from stdin and serve until told to stop."""
    parser = argparse.ArgumentParser(prog="python -m pagoda.server.core")
    parser.add_argument("--log-level", type=int, default=20)
    args = parser.parse_args()
    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CoreSpec)
    run_engine_core(spec, args.log_level)


if __name__ == "__main__":
    main()
