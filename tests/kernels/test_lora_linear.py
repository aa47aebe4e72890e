"""The grouped LoRA product beside a base linear (`rollout.kernels.lora_linear`): segments of a step, slices and
index tensors, slots that leave a linear alone, against `base(x) + scale * x @ A.T @ B.T` row by row."""

from __future__ import annotations

import torch

from rollout.kernels.lora_linear import LoraContext, plan_step, route_through_stack
from rollout.weights.lora_adapters import LoraModule
from rollout.weights.lora_table import LoraStack


def test_plan_step_merges_adjacent_rows_and_gathers_the_rest():
    plan = plan_step([0, 0, None, 1, 0], [3, 1, 2, 4, 2], torch.device("cpu"))
    segments = dict(plan.segments)
    assert segments[1] == slice(6, 10)
    assert segments[0].tolist() == [0, 1, 2, 3, 10, 11]  # NOTE: rows 0-1 one run, row 4 another
    assert plan_step([None, None], [2, 5], torch.device("cpu")) is None


def test_deltas_follow_each_rows_slot():
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(8, 6)
    stack = LoraStack(max_loras=3, max_rank=4, linear=linear)
    mods = {0: LoraModule(torch.randn(2, 8, generator=g), torch.randn(6, 2, generator=g), 0.5),
            2: LoraModule(torch.randn(4, 8, generator=g), torch.randn(6, 4, generator=g), 2.0)}
    for slot, m in mods.items():
        stack.load(slot, m)
    stack.load(1, None)  # NOTE: slot 1's adapter leaves this linear alone
    ctx = LoraContext()
    route_through_stack(linear, stack, ctx, "proj")
    slots, lens = [2, None, 0, 1, 2, 0], [3, 2, 1, 2, 2, 1]
    x = torch.randn(1, sum(lens), 8, generator=g)
    with torch.no_grad():
        assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))  # NOTE: no plan
        ctx.plan = plan_step(slots, lens, x.device)
        got = linear(x)[0]
        want = torch.nn.functional.linear(x, linear.weight, linear.bias)[0]
    row = 0
    for slot, n in zip(slots, lens, strict=True):
        if slot in mods:
            m = mods[slot]
            want[row : row + n] += (x[0, row : row + n] @ m.a.T) @ m.b.T * m.scale
        row += n
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
