"""`EngineBridge.collect` / `updates`: the one loop the OpenAI, `/inference/v1/generate` and SGLang routes read
their samples' outputs with (a request's samples until done, a stop string's cancel, the final output that carries
routes, a client gone, a failed sample as a 500), on a queue filled by hand."""

from __future__ import annotations

import asyncio

import pytest

import rollout.serve.bridge as bridge_module
from rollout.requests import GenerationOutput, RequestStatus
from rollout.serve.bridge import EngineBridge
from rollout.serve.protocol import APIError
from rollout.serve.text import SampleText

RUNNING, DONE, CANCELLED, FAILED = (RequestStatus.DECODING, RequestStatus.FINISHED, RequestStatus.CANCELLED,
                                    RequestStatus.FAILED)


class Digits:
    """Decodes token t as the digit string of t."""

    def decode(self, tokens, skip_special_tokens=True) -> str:
        return "".join(str(t) for t in tokens)


def bridge_and_cancels() -> tuple[EngineBridge, list[str]]:
    bridge = object.__new__(EngineBridge)  # NOTE: no engine: collect / updates use cancel and counters only
    cancelled: list[str] = []
    bridge.cancel = cancelled.extend
    bridge.counters = {"requests": 0, "samples": 0, "failed": 0}
    return bridge, cancelled


def texts(*stops: list[str]) -> dict[str, SampleText]:
    return {f"r{i}": SampleText(i, [1, 2], Digits(), list(s)) for i, s in enumerate(stops)}


def out(rid: str, tokens: list[int], status: RequestStatus, reason: str | None = None, error: str | None = None):
    return GenerationOutput(rid, [1, 2], tokens, status=status, finish_reason=reason, error=error)


async def never_gone() -> bool:
    return False


def run(bridge, outputs, samples, routes=False, disconnected=never_gone):
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for o in outputs:
            queue.put_nowait(o)
        return await bridge.collect(queue, samples, routes, disconnected)

    return asyncio.run(main())


def test_collect_reads_until_every_sample_is_done_and_cancels_a_stop_strings_sample():
    bridge, cancelled = bridge_and_cancels()
    samples = texts([], ["7"])
    outputs = [out("r0", [3], RUNNING), out("r1", [4, 7], RUNNING), out("r0", [3, 5], DONE, "length")]
    assert run(bridge, outputs, samples) is True
    assert [(s.text, s.finish_reason) for s in samples.values()] == [("35", "length"), ("4", "stop")]
    assert cancelled == ["r1"]  # the stop string's sample, once; nothing was left running after


def test_with_routes_collect_waits_for_the_cancelled_final_output_that_carries_them():
    bridge, cancelled = bridge_and_cancels()
    samples = texts(["7"])
    final = out("r0", [4, 7, 8], CANCELLED, "cancelled")
    assert run(bridge, [out("r0", [4, 7], RUNNING), final], samples, routes=True) is True
    assert samples["r0"].final is final and samples["r0"].text == "4" and cancelled == ["r0"]
    samples = texts(["7"])  # NOTE: without routes the stop is the end: the final output is not waited for
    assert run(bridge, [out("r0", [4, 7], RUNNING)], samples) is True and samples["r0"].final is None


def test_a_failed_sample_is_a_500_naming_its_error_and_the_others_are_cancelled():
    bridge, cancelled = bridge_and_cancels()
    samples = texts([], [])
    outputs = [out("r0", [3], RUNNING), out("r1", [], FAILED, "error", "out of pages"), out("r0", [3, 4], DONE, "stop")]
    with pytest.raises(APIError, match="generation failed: out of pages") as e:
        run(bridge, outputs, samples)
    assert (e.value.status, e.value.type, bridge.counters["failed"]) == (500, "server_error", 1)
    assert cancelled == []


@pytest.mark.timeout(20)
def test_a_client_gone_ends_collect_with_false_and_cancels_what_runs(monkeypatch):
    monkeypatch.setattr(bridge_module, "DISCONNECT_POLL_S", 0.01)
    bridge, cancelled = bridge_and_cancels()
    asked = []

    async def gone() -> bool:
        asked.append(1)
        return len(asked) > 2  # NOTE: still there for two silent polls, then gone

    samples = texts([], [])
    assert run(bridge, [out("r1", [5], DONE, "length")], samples, disconnected=gone) is False
    assert len(asked) == 3 and cancelled == ["r0"]  # r1 had finished


def test_updates_yield_each_running_samples_new_text_and_skip_the_done():
    bridge, cancelled = bridge_and_cancels()
    samples = texts([], ["7"])
    outputs = [out("r1", [4, 7], RUNNING), out("r0", [3], RUNNING), out("r1", [4, 7, 9], CANCELLED, "cancelled"),
               out("r0", [3, 5], FAILED, "error", "boom")]

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for o in outputs:
            queue.put_nowait(o)
        return [(s.index, delta, s.finish_reason) async for s, delta in bridge.updates(queue, samples)]

    assert asyncio.run(main()) == [(1, "4", "stop"), (0, "3", None), (0, "5", "error")]
    assert cancelled == ["r1"]
