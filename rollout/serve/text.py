"""`SampleText`: one sample's tokens as text, growing chunk by chunk, cut at the first stop string.

The text is the decode of all tokens so far, so the streamed deltas join to exactly the text a
non-streamed request returns. While generation runs, a tail that could still become a stop string, or an
incomplete multi-byte character (U+FFFD), is held back.
"""

from __future__ import annotations

from rollout.requests import GenerationOutput

FINISH_REASONS = {"cancelled": "abort"}  # vLLM's name for an aborted request


class SampleText:
    """State of one sample (choice) of an HTTP request.

    Args:
        index: the choice index (prompt-major: i * n + j).
        prompt_ids: its prompt's token ids.
        tokenizer: decodes tokens (None: text stays empty).
        stops: stop strings; the text ends before the first one and the sample finishes with "stop".
        skip_special_tokens: passed to `tokenizer.decode`.
    """

    def __init__(self, index: int, prompt_ids: list[int], tokenizer, stops: list[str],
                 skip_special_tokens: bool = True) -> None:
        self.index = index
        self.prompt_ids = prompt_ids
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = None
        self.versions: list[int] = []  # policy_version that sampled each token
        self.text = ""  # emitted so far
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cached_tokens = 0
        self.sent_tokens = 0  # token ids already streamed
        self.prompt_text: str | None = None  # the prompt as sent, when a string (echo returns it)
        self.final: GenerationOutput | None = None  # the final output (top and prompt logprobs live there)
        self.top: tuple[list[list[float]], list[list[int]]] | None = None  # top k of each generated token
        self.ranks: list[int] | None = None  # the rank of each generated token (with a top k)
        self.ids_as_tokens = False  # token strings of logprobs as "token_id:N" (return_tokens_as_token_ids)
        self.masks: list[list[int]] | None = None  # each token's sampling support (with return_sampling_mask)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def routes(self):
        """`[len(prompt) + len(tokens) - 1, L, k]`: the routed experts of every token returned but the last (vLLM's
        rows), from the final output; None if it recorded none."""
        routes = None if self.final is None else self.final.routed_experts
        return None if routes is None else routes[: len(self.prompt_ids) + len(self.tokens) - 1]

    def absorb(self, out: GenerationOutput) -> str:
        """Take a (partial or final) output; returns the new text to emit (possibly empty)."""
        if self.done:
            if out.status.is_final and self.final is None:
                self.final = out  # NOTE: cut by a stop string, then cancelled: its routed experts come with this
            return ""
        self.tokens = list(out.generated_tokens)
        self.logprobs = out.logprobs
        self.versions = list(out.versions or [])
        self.cached_tokens = out.num_cached_tokens
        if out.top_logprobs is not None:
            self.top, self.ranks = (out.top_logprobs, out.top_ids), out.top_ranks
        self.masks = out.sampling_masks
        final = out.status.is_final
        if final:
            self.final = out
        full = self._decode(self.tokens)
        cut = self._find_stop(full)
        if cut is not None:
            full, final = full[:cut], True
            self.finish_reason = "stop"
        elif final:
            self.finish_reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
            self.error = out.error
        end = len(full)
        if not final:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            end = max(len(self.text), len(full.rstrip("\ufffd")) - hold)
        delta = full[len(self.text):end]
        self.text += delta
        return delta

    def new_tokens(self) -> tuple[list[int], list[float] | None]:
        """Token ids (and logprobs) not yet streamed."""
        start, self.sent_tokens = self.sent_tokens, len(self.tokens)
        lps = None if self.logprobs is None else self.logprobs[start:]
        return self.tokens[start:], lps

    def _decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip)

    def _find_stop(self, full: str) -> int | None:
        if not self.stops:
            return None
        start = max(0, len(self.text) - max(len(s) for s in self.stops))
        hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def token_strings(self, tokens: list[int]) -> list[str]:
        if self.ids_as_tokens:  # NOTE: vLLM's return_tokens_as_token_ids
            return [f"token_id:{t}" for t in tokens]
        if self.tokenizer is None:
            return [""] * len(tokens)
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
