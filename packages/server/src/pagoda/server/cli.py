"""Command-line entry point: `pagoda serve [MODEL]`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the `pagoda` command line."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "serve":
        print("usage: pagoda serve [MODEL] [OPTIONS]", file=sys.stderr)
        return 2
    print("pagoda: the OpenAI-compatible server is not built yet (see the server issue).", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
