"""Prefix-aware routing: send a prompt to the server whose KV cache holds its longest prefix.

A pool's later requests often extend earlier ones: an agent's next turn is its last prompt plus the reply and
the tool's answer; a GRPO epoch revisits its prompts. Least-loaded routing scatters them, and every server
prefills them again. `PrefixRouter` remembers, for the block-aligned prefixes of the prompts it routed
(`block_tokens` ids per block, chained hashes as the engine's prefix cache keys its pages), which server took
them; `pick` goes to the server holding the longest known prefix unless it has `max_imbalance` more requests
in flight than the least-loaded server (SGLang's cache-aware router balances the same way), else to the
least loaded. The table is an LRU of at most `max_entries` block hashes, so memory is bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

DEFAULT_BLOCK_TOKENS = 16  # NOTE: the engine's default page size: a cached prefix is whole pages of it
DEFAULT_MAX_IMBALANCE = 4
DEFAULT_MAX_ENTRIES = 1 << 18


class PrefixRouter:
    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if block_tokens < 1 or max_imbalance < 0 or max_entries < 1:
            raise ValueError(f"block_tokens and max_entries must be >= 1 and max_imbalance >= 0, got "
                             f"{block_tokens}, {max_entries}, {max_imbalance}")
        self.block_tokens, self.max_imbalance, self.max_entries = block_tokens, max_imbalance, max_entries
        self.owner: OrderedDict[int, str] = OrderedDict()  # chained block hash -> the server that took it
        self.routed = self.prefix_routed = 0  # picks, and those that followed a known prefix

    def block_hashes(self, ids: Sequence[int]) -> list[int]:
        """The chained hashes of `ids`' whole blocks (a block's hash covers every token before it too)."""
        out, h, b = [], 0, self.block_tokens
        for end in range(b, len(ids) + 1, b):
            h = hash((h, tuple(ids[end - b:end])))
            out.append(h)
        return out

    def pick(self, ids: Sequence[int], load: Mapping[str, int], candidates: Sequence[str]) -> str:
        """The server for a prompt `ids` among `candidates` (`load`: requests in flight per server)."""
        least = min(candidates, key=lambda u: load[u])
        hashes = self.block_hashes(ids)
        self.routed += 1
        for h in reversed(hashes):  # NOTE: the longest known prefix first
            url = self.owner.get(h)
            if url is not None and url in candidates:
                if load[url] - load[least] <= self.max_imbalance:
                    self.prefix_routed += 1
                    self.record(hashes, url)
                    return url
                break
        self.record(hashes, least)
        return least

    def record(self, hashes: Sequence[int], url: str) -> None:
        for h in hashes:
            self.owner[h] = url
            self.owner.move_to_end(h)
        while len(self.owner) > self.max_entries:
            self.owner.popitem(last=False)

    def clear(self) -> None:
        """Forget every prefix (the servers dropped their caches: new weights)."""
        self.owner.clear()

    def forget(self, url: str) -> None:
        """Drop a server (dead, or its cache reset): its prefixes route by load again."""
        for h in [h for h, u in self.owner.items() if u == url]:
            del self.owner[h]
