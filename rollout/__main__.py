"""`rollout` console script and `python -m rollout`: `rollout serve MODEL_PATH [flags]`,
`rollout tinker-serve BASE_MODEL_DIR [flags]`."""

from __future__ import annotations

import sys

USAGE = ("usage: rollout serve MODEL_PATH [flags]   (rollout serve --help for the flags)\n"
         "       rollout tinker-serve BASE_MODEL_DIR [flags]   (the Tinker API; rollout tinker-serve --help)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "tinker-serve":
        from rollout.tinker.cli import main as tinker_main

        return tinker_main(argv[1:])
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 2
    from rollout.serve.cli import main as serve_main

    return serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
