"""Random add / cancel / stop / start / wait sequences against one manager (hypothesis state machine).

Checked after every wait and at teardown: every accepted request delivered exactly one final result,
finished ones equal the greedy oracle, cancelled / failed ones hold a prefix of it, and no KV page
leaks (every page free when idle, block-manager invariants hold). A tiny cache (page_size 4, 12 pages)
and prompts that share prefixes make preemption and prefix-cache hits frequent.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from support.threads import guarded
from support.tiny_models import hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RequestStatus, init_continuous_batching

MAX_NEW = 4
PAGE, BLOCKS = 4, 12  # 48 tokens of KV in all
WAIT_TIMEOUT = 60.0

# 3 unrelated prompts + 3 sharing a 9-token prefix; all fit the cache alone (<= 40 + 4 tokens)
PROMPTS = random_prompts(3, 1, 30, seed=11) + random_prompts(3, 10, 31, seed=12, shared_prefix=9, n_shared=3)
OVERSIZED = [9] * 50  # 50 + 1 tokens: 13 pages > 12
GC = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None)
CBC = ContinuousBatchingConfig(page_size=PAGE, num_blocks=BLOCKS, max_batch_tokens=24, safety_margin=0.0)


@functools.cache
def _world() -> tuple[torch.nn.Module, list[list[int]]]:
    """The model and each prompt's greedy oracle (built on first use, not at collection)."""
    model = make_model("qwen3", seed=3)
    return model, [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]


def _guarded(fn, timeout: float = WAIT_TIMEOUT):
    return guarded(fn, timeout)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        model, self.oracle = _world()
        self.manager = init_continuous_batching(model, generation_config=GC, continuous_batching_config=CBC)
        self.accepting = False
        self.counter = 0
        self.pending: dict[str, tuple[int, int, bool]] = {}  # id -> (prompt index, max_new_tokens, streaming)
        self.cancelled: set[str] = set()
        self.hard_stopped: set[str] = set()  # pending when a hard stop was requested

    @initialize()
    def start_manager(self) -> None:
        self.manager.start()
        self.accepting = True

    # ----------------------------------------------------------------- rules
    @rule(p=st.integers(0, len(PROMPTS) - 1), n=st.one_of(st.none(), st.integers(1, MAX_NEW)),
          streaming=st.booleans())
    def add(self, p: int, n: int | None, streaming: bool) -> None:
        rid = f"q{self.counter}"
        self.counter += 1
        got = self.manager.add_request(PROMPTS[p], request_id=rid, max_new_tokens=n, streaming=streaming)
        if not self.accepting:
            assert got is None
            return
        assert got == rid
        self.pending[rid] = (p, GC.max_new_tokens if n is None else n, streaming)

    @rule(ps=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=4), n=st.integers(1, MAX_NEW))
    def add_many(self, ps: list[int], n: int) -> None:
        ids = self.manager.add_requests([PROMPTS[p] for p in ps], max_new_tokens=n)
        if not self.accepting:
            assert ids == []
            return
        assert len(ids) == len(ps) and len(set(ids)) == len(ids)
        for rid, p in zip(ids, ps, strict=True):
            self.pending[rid] = (p, n, False)

    @precondition(lambda self: self.accepting)
    @rule()
    def add_oversized(self) -> None:
        with pytest.raises(ValueError):
            self.manager.add_request(OVERSIZED, max_new_tokens=1)

    @rule(pick=st.integers(0, 255))
    def cancel(self, pick: int) -> None:
        # NOTE: which requests are still pending depends on timing, so draw an index, not an element
        # (hypothesis needs draws that do not depend on the run).
        choices = sorted(self.pending) + ["never-submitted"]
        rid = choices[pick % len(choices)]
        ok = self.manager.cancel_request(rid)
        if rid not in self.pending:
            assert ok is False
        elif ok:
            self.cancelled.add(rid)
        else:
            assert not self.manager.is_running()

    @rule(hard=st.booleans())
    def stop(self, hard: bool) -> None:
        if hard:
            self.hard_stopped |= set(self.pending)
        _guarded(lambda: self.manager.stop(hard_stop=hard))
        self.accepting = False
        assert not self.manager.is_running()
        self.collect()

    @rule(hard=st.booleans())
    def stop_nonblocking(self, hard: bool) -> None:
        """Returns at once; a later start() must wait for this session to end and then accept work."""
        if hard:
            self.hard_stopped |= set(self.pending)
        self.manager.stop(hard_stop=hard, block=False)
        self.accepting = False

    @rule()
    def start(self) -> None:
        self.manager.start()
        self.accepting = True

    @rule()
    def wait_for_finish(self) -> None:
        self.collect()

    @rule()
    def poll(self) -> None:
        out = self.manager.get_result(timeout=0)
        if out is not None:
            self.check(out)

    # -------------------------------------------------------------- checks
    def collect(self) -> None:
        """Consume every pending request's final result: streams through `request_id_iter`, the rest
        through `for result in manager`; then nothing may be left or leak."""
        for rid in [r for r, (_, _, s) in self.pending.items() if s]:
            chunks = _guarded(lambda rid=rid: list(self.manager.request_id_iter(rid)))
            if not chunks:  # its final result was taken by an earlier poll()
                assert rid not in self.pending
                continue
            lengths = [len(c.generated_tokens) for c in chunks]
            assert lengths == sorted(lengths)
            assert all(not c.status.is_final for c in chunks[:-1])
            p, n, _ = self.pending[rid]
            assert all(c.generated_tokens == self.oracle[p][: len(c.generated_tokens)] for c in chunks)
            self.check(chunks[-1])
        for out in _guarded(lambda: list(self.manager)):
            self.check(out)
        assert not self.pending, f"no final result for {sorted(self.pending)}"
        assert self.manager.get_result(timeout=0) is None
        with self.manager.step_lock:
            stats = self.manager.cache_stats()
            self.manager.core.page_pool.check_invariants()
        assert stats["free_blocks"] == stats["num_blocks"] == BLOCKS, stats
        assert not self.manager.core.requests

    def check(self, out) -> None:
        assert out.status.is_final, out
        assert out.request_id in self.pending, f"{out.request_id} delivered twice or never submitted"
        p, n, _ = self.pending.pop(out.request_id)
        ref = self.oracle[p][:n]
        assert out.prompt_ids == PROMPTS[p]
        if out.status == RequestStatus.FINISHED:
            assert out.generated_tokens == ref and out.finish_reason == "length"
        elif out.status == RequestStatus.CANCELLED:
            assert out.request_id in self.cancelled and out.finish_reason == "cancelled"
            assert out.generated_tokens == ref[: len(out.generated_tokens)]
        else:
            assert out.request_id in self.hard_stopped, out
            assert out.finish_reason == "error" and "hard_stop" in out.error
            assert out.generated_tokens == ref[: len(out.generated_tokens)]

    def teardown(self) -> None:
        try:
            _guarded(lambda: self.manager.stop())
            self.collect()
        finally:
            self.manager.destroy()


ManagerMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerStateMachine = ManagerMachine.TestCase
