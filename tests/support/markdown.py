"""The fenced code blocks of the README and docs pages, for the tests that run or check them."""

from __future__ import annotations

import re

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)  # NOTE: (language, body) of each fenced block


def fenced_blocks(text: str, lang: str) -> list[str]:
    """The bodies of `text`'s fenced blocks in language `lang`."""
    return [body for tag, body in FENCE.findall(text) if tag == lang]
