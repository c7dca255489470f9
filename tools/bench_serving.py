"""Serving benchmark for any OpenAI-compatible endpoint: `pagoda.server.bench.serving`'s command line (its
docstring, `--help`, lists the options; `pagoda bench serve` runs the same benchmark with vLLM's flag names), plus
`--serve`, which starts `pagoda serve` configurations here through pagoda.server.testing's LiveServer.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --model NAME --request-rate 2 inf
    python tools/bench_serving.py --serve "pagoda=-q gguf" --single-stream
    python tools/bench_serving.py --disagg     # colocated DP=2 against 1 prefill + 1 decode core (issue 40)
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from pagoda.server.bench.serving import SERVED_NAME, main


@contextmanager
def launched(args: argparse.Namespace, flags: str) -> Iterator[str]:
    """A `pagoda serve` of --serve-model started with `flags`, healthy, until the block ends (SIGTERM); yields its
    root URL."""
    # Imported here: benchmarking servers given by --base-url (a peer such as vLLM) needs no Pagoda engine.
    from pagoda.server.testing import LiveServer

    server = LiveServer(
        args.serve_model,
        shlex.split(flags),
        served_model_name=SERVED_NAME,
        ready_timeout=900,
        poll_interval=0.5,
        stop_timeout=120,
        capture_log=False,  # the server's warnings go to this terminal, between the benchmark's lines
    )
    with server:
        # One request first, so that one-time costs (kernel selection, first allocations) stay out of the numbers.
        body = {"model": SERVED_NAME, "prompt": "warm up the server", "max_tokens": 8}
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=600).raise_for_status()
        yield server.base_url


if __name__ == "__main__":
    if "--disagg" in sys.argv[1:]:
        from pagoda.pagedkernel.cbuild import cpu_name
        from pagoda.server.bench.disagg import main as disagg_main

        sys.exit(disagg_main(sys.argv[1:], launched, cpu_name()))
    sys.exit(main(launch=launched))
