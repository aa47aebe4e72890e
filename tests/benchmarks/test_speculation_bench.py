"""`benchmarks/speculation.py`'s measure of how much a text repeats (issue 60): transformers' prompt lookup replayed
over it (`prompt_lookup_kept`), on texts whose answers are worked out by hand; and what it lets pass of a run whose
tokens part from plain decoding (`parted`: an fp32 tie only)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from speculation import parted, prompt_lookup_kept  # noqa: E402


def test_prompt_lookup_keeps_a_loop_and_nothing_of_new_text():
    prompt, loop = [9, 1, 2, 3, 4], [1, 2, 3, 4] * 3
    # NOTE: "3 4" and "4" occur only at the end: no draft, the model's 1; then "1" (no earlier "4 1") at 1 drafts
    # 2 3 4 1 (up to the text's end), all kept, +1; then "1 2" at 1 drafts 3 4 1 2 3 4 1 2, cut to the 5 left
    # before the last token (the model's own), all kept
    assert prompt_lookup_kept([prompt], [loop]) == (9, 9)
    assert prompt_lookup_kept([[5, 6, 7]], [[10, 11, 12, 13]]) == (0, 0)


def test_prompt_lookup_takes_the_first_occurrence_and_stops_at_the_first_miss():
    prompt = [1, 2, 3, 5, 1, 2, 3, 6, 1, 2]
    # NOTE: "1 2" first at 0: drafts 3 5 (cut to the 2 before the last token); the text goes 3 4: 1 kept, 4 the
    # model's; then 1 token left, the model's
    assert prompt_lookup_kept([prompt], [[3, 4, 0]]) == (2, 1)
    # NOTE: two rows add up
    assert prompt_lookup_kept([prompt, [9, 1, 2, 3, 4]], [[3, 4, 0], [1, 2, 3, 4] * 3]) == (11, 10)


class _Fixed(torch.nn.Module):
    """A "model" whose last position's logits are `logits` whatever the input (`parted` reads them in fp64)."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float32), requires_grad=False)
        self.device = torch.device("cpu")

    def forward(self, ids):
        return SimpleNamespace(logits=self.logits.expand(1, ids.shape[1], -1))


def test_a_parting_passes_only_at_a_tie_between_the_two_best_tokens():
    wl = SimpleNamespace(prompts=[[1, 2], [3, 4]])
    tie = [-5.0, 2.0, -5.0, 2.0 + 2e-6, -5.0, 1.0]
    # NOTE: row 1 parts at its second token between tokens 1 and 3, the top two, 2e-6 apart: a tie
    assert parted(_Fixed(tie), wl, [[0, 0], [5, 1]], [[0, 0], [5, 3]])
    assert not parted(_Fixed(tie), wl, [[0, 0], [5, 1]], [[0, 0], [5, 5]])  # NOTE: 5 is not in the top two
    third = [-5.0, 2.0, -5.0, 2.0 + 2e-6, -5.0, 2.0 + 1e-6]
    assert not parted(_Fixed(third), wl, [[0, 0], [5, 1]], [[0, 0], [5, 3]])  # NOTE: close, but 1 is the third
    wide = [-5.0, 2.0, -5.0, 2.001, -5.0, 1.0]
    assert not parted(_Fixed(wide), wl, [[0, 0], [5, 1]], [[0, 0], [5, 3]])  # NOTE: 1e-3 apart: no tie
    assert parted(_Fixed(wide), wl, [[0, 0], [5, 1]], [[0, 0], [5, 1]])  # NOTE: no parting at all
