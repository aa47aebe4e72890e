"""A math verifier: the final answer of a solution, compared as a number when it is one.

    extract_final_answer("... so she has 72 left.\\n#### 72")   # "72"
    extract_final_answer("the total is \\\\boxed{1,024}")        # "1024"
    math_reward(completions=["... = 72", "71"], answer=["... #### 72", "#### 72"])   # [1.0, 0.0]

The answer is, in this order of preference: what follows the last `####` (GSM8K), the content of
the last `\\boxed{...}` (MATH, braces balanced), else the last number in the text. Both the
completion and the reference go through the same extraction, so a GSM8K answer column with its
worked solution compares by its final number.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def normalize(answer: str) -> str:
    """Canonical text of an answer: a number without thousands separators, units signs or a
    trailing zero fraction ("1,024.0" -> "1024", "$5" -> "5"); anything else stripped of spaces."""
    text = answer.strip().strip(".").replace("$", "").replace("\\%", "").replace("%", "").strip()
    match = NUMBER.fullmatch(text)
    if match is None:
        return " ".join(text.split())
    value = text.replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    if value in ("-0", ""):
        value = "0"
    return value


def extract_final_answer(text: str) -> str | None:
    """The final answer of a solution text (see the module docstring), normalized; None if none."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        numbers = NUMBER.findall(tail)
        return normalize(numbers[0] if numbers else tail.splitlines()[0] if tail else "") or None
    boxed = _last_boxed(text)
    if boxed is not None:
        return normalize(boxed) or None
    numbers = NUMBER.findall(text)
    return normalize(numbers[-1]) if numbers else None


def _text(completion: Any) -> str:
    # NOTE: conversational completions arrive as [{"role": "assistant", "content": text}] (TRL).
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def math_reward(completions: Sequence[Any], answer: Sequence[Any], **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the reference's (both extracted), else 0.0.

    A TRL-style reward function: called by keyword with the dataset's `answer` column."""
    out = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = extract_final_answer(str(reference))
        got = extract_final_answer(_text(completion))
        out.append(float(expected is not None and got == expected))
    return out
