"""Shared pieces of the benchmarks: models, RL-like workloads, the three systems, checks, FLOP counting.

The three systems, each driven the way a user would, on the same model object and the same requests:

- `run_ours`: rollout's `EngineCore` with the DEFAULT `ContinuousBatchingConfig()`, driven exactly as
  `rollout.generate_batch` drives it, except that each request gets its own `max_new_tokens`
  (`generate_batch` applies one value to every request).
- `run_hf_cb`: transformers' own continuous batching manager (`model.continuous_batching_context_manager`,
  `manager.add_request(..., max_new_tokens=n)` per request), tuned: small pages, `num_blocks` sized to
  the workload, `max_batch_tokens` set.
- `run_generate`: one padded `model.generate` call (left padding), which runs every row to the longest
  `max_new_tokens`; only each request's own first `n` tokens count as useful.

No EOS anywhere (`eos_token_id=None`): each request ends at its own `max_new_tokens`, standing in for the
EOS that would end it in a real rollout.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

# --------------------------------------------------------------------------------------------- models

MODEL_SPECS = {
    # ~5M params: hidden 256, 4 layers, vocab 4096 (untied head)
    "5m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=False),
    # ~100M params: hidden 768, 12 layers, vocab 32768 (tied head, like small Qwen3 checkpoints)
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64, vocab_size=32768, tie_word_embeddings=True),
    # ~135M params: SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads over 3 KV heads, vocab 49152, tied head)
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_model(size: str = "5m", dtype: str = "fp32", seed: int = 0, initializer_range: float = 0.3):
    """A random Qwen3-architecture model in eval mode with sdpa attention.

    `initializer_range` is raised above the usual 0.02 so that the logits are peaked and greedy decoding
    does not hinge on near-ties that two correct kernels may break differently.
    """
    torch.manual_seed(seed)
    config = Qwen3Config(max_position_embeddings=2048, initializer_range=initializer_range, **MODEL_SPECS[size])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=DTYPES[dtype])
    return model.eval()


def matmul_params(model) -> tuple[int, int]:
    """(parameters of the Linear layers inside the decoder layers, parameters of the LM head).

    Embedding lookups and norms are not matmuls; the head is counted separately because it only runs
    on the rows whose logits are asked for.
    """
    body = sum(m.weight.numel() for name, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear))
    head = model.lm_head.weight.numel()
    return body, head


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------- workload


@dataclass
class Workload:
    prompts: list[list[int]]  # one per request (a group's G requests share the same prompt list)
    max_new: list[int]  # per request
    group_size: int = 1

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_new)

    def describe(self) -> str:
        pl = [len(p) for p in self.prompts[:: self.group_size]]
        return (f"{len(pl)} prompts x G={self.group_size} = {self.num_requests} requests, prompt len "
                f"{min(pl)}-{max(pl)} (mean {statistics.mean(pl):.0f}), completion len {min(self.max_new)}-"
                f"{max(self.max_new)} (mean {statistics.mean(self.max_new):.0f}), {self.useful_tokens} useful tokens")

    def subset(self, idx: list[int]) -> Workload:
        return Workload([self.prompts[i] for i in idx], [self.max_new[i] for i in idx], 1)


def rl_workload(num_prompts: int, group_size: int, vocab: int, prompt_len=(16, 512), completion_len=(8, 256),
                seed: int = 0) -> Workload:
    """P prompts x G samples; each sample draws its own completion length (as EOS would end it)."""
    rng = random.Random(seed)
    prompts, max_new = [], []
    for _ in range(num_prompts):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_len))]
        for _ in range(group_size):
            prompts.append(prompt)
            max_new.append(rng.randint(*completion_len))
    return Workload(prompts, max_new, group_size)


def decode_workload(concurrency: int, vocab: int, prompt_len: int = 32, new_tokens: int = 128,
                    seed: int = 0) -> Workload:
    """`concurrency` distinct short prompts that all decode `new_tokens`: the batch stays full throughout."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
    return Workload(prompts, [new_tokens] * concurrency, 1)


def greedy_config(new_tokens: int | None = None) -> GenerationConfig:
    """Greedy, no EOS; with `new_tokens`, exactly that many (for `model.generate`)."""
    extra = {} if new_tokens is None else dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None, **extra)


# -------------------------------------------------------------------------------------------- systems


@dataclass
class RunResult:
    system: str
    seconds: float  # wall clock
    outputs: list[list[int]]  # per request, the useful (first max_new) tokens
    executed_body_tokens: int | None = None  # tokens actually run through the decoder layers, when known
    executed_head_rows: int | None = None
    extra: dict = field(default_factory=dict)
    cpu_seconds: float = 0.0  # CPU time of this process during the run (all threads), set by `timed`


def timed(fn, *args, **kwargs) -> RunResult:
    """Run a system and record the process CPU time too.

    On a shared, oversubscribed box the wall clock counts the time this process waited for a core;
    with one intra-op thread the CPU time is close to what an idle core would take. Both are reported.
    """
    c0 = time.process_time()
    r = fn(*args, **kwargs)
    r.cpu_seconds = time.process_time() - c0
    return r


def step_to_end(core, reqs) -> int:
    """Add `reqs` to the `EngineCore` and step it until it has no work; returns the number of steps."""
    for r in reqs:
        core.add(r)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    return steps


def run_core(core, wl: Workload) -> tuple[float, float, list[list[int]]]:
    """Every request of `wl` through an existing `EngineCore` (kept alive across runs, as in RL
    training), greedy; returns (CPU seconds of this process, wall seconds, generated tokens)."""
    reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=n)
            for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
    c0, w0 = time.process_time(), time.perf_counter()
    step_to_end(core, reqs)
    return time.process_time() - c0, time.perf_counter() - w0, [r.generated for r in reqs]


def run_ours(model, wl: Workload, cbc=None, warm: bool = False) -> RunResult:
    """rollout with its default config: `generate_batch`'s loop, per-request `max_new_tokens`. The engine is built
    inside the timing, unless `warm`: then it is built and warmed up first, outside it, on the warm-up `run_vllm`
    gives vLLM (the first 16 tokens of 4 prompts, 8 new tokens each), as a persistent engine in a training loop is."""
    from rollout import ContinuousBatchingConfig
    from rollout.engine.core import EngineCore

    def engine():
        return EngineCore(model, greedy_config(), cbc if cbc is not None else ContinuousBatchingConfig())

    core, before = None, {}
    if warm:
        core = engine()
        step_to_end(core, [core.make_request(p[:16], request_id=f"warmup_{i}", max_new_tokens=8)
                           for i, p in enumerate(wl.prompts[:4])])
        before = core.cache_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    core = core if core is not None else engine()
    reqs = [core.make_request(ids, request_id=f"req_{i}", max_new_tokens=n)
            for i, (ids, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
    steps = step_to_end(core, reqs)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    outs = [r.to_output() for r in reqs]
    bad = [o for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"ours: {len(bad)} requests did not finish by length: {bad[0].finish_reason} {bad[0].error}")
    st = core.cache_stats()
    st.update({key: st[key] - before.get(key, 0) for key in ("computed_prompt_tokens", "generated_tokens",
                                                             "cached_prompt_tokens", "preemptions")})
    # NOTE: the last token of each request is sampled but never fed back; recomputation after preemption
    # is not included (see extra["preemptions"]).
    body = st["computed_prompt_tokens"] + st["generated_tokens"] - len(reqs)
    return RunResult("ours", dt, [o.generated_tokens for o in outs], body, st["generated_tokens"],
                     dict(steps=steps, cached_prompt_tokens=st["cached_prompt_tokens"], preemptions=st["preemptions"],
                          num_blocks=st["num_blocks"], page_size=st["page_size"],
                          max_batch_tokens=st["max_batch_tokens"], cpu_timed=cpu))


def hf_cb_config(wl: Workload, page_size: int = 32, max_batch_tokens: int = 512):
    """transformers' CB config tuned for this workload: small pages, just enough blocks, a set token budget."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as HFConfig

    blocks = sum(math.ceil((len(p) + n) / page_size) for p, n in zip(wl.prompts, wl.max_new, strict=True))
    return HFConfig(page_size=page_size, num_blocks=blocks + 16, max_batch_tokens=max_batch_tokens,
                    max_requests_per_batch=None, scheduler_type="fifo")


def run_hf_cb(model, wl: Workload, page_size: int = 32, max_batch_tokens: int = 512) -> RunResult:
    """transformers' ContinuousBatchingManager, one `add_request` per request with its own max_new_tokens."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    cbc = hf_cb_config(wl, page_size, max_batch_tokens)
    gc = greedy_config()
    t0 = time.perf_counter()
    results = {}
    with torch.no_grad(), model.continuous_batching_context_manager(
        generation_config=copy.deepcopy(gc), continuous_batching_config=cbc, block=True, timeout=30,
    ) as manager:
        ids = [manager.add_request(input_ids=p, request_id=f"req_{i}", max_new_tokens=n, eos_token_id=-1)
               for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers CB: generation thread died")
                continue
            if r.is_finished():
                results[r.request_id] = r
    dt = time.perf_counter() - t0
    errors = [r.error for r in results.values() if r.error]
    if errors:
        raise RuntimeError(f"transformers CB: {len(errors)} failed: {errors[0]}")
    outs = [list(results[i].generated_tokens) for i in ids]
    return RunResult("hf_cb", dt, outs, extra=dict(page_size=page_size, num_blocks=cbc.num_blocks,
                                                  max_batch_tokens=max_batch_tokens))


@torch.no_grad()
def run_generate(model, wl: Workload) -> RunResult:
    """One padded `model.generate` over every request (left padding), run to the longest max_new_tokens."""
    longest = max(len(p) for p in wl.prompts)
    steps = max(wl.max_new)
    t0 = time.perf_counter()
    ids = torch.zeros(wl.num_requests, longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(wl.prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                         generation_config=greedy_config(steps))
    if out.is_cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    gen = out[:, longest:].tolist()
    outs = [g[:n] for g, n in zip(gen, wl.max_new, strict=True)]
    rows = wl.num_requests
    return RunResult("generate", dt, outs, rows * (longest + steps - 1), rows * steps)


@torch.no_grad()
def generate_one(model, prompt: list[int], n: int) -> list[int]:
    """The oracle: unbatched greedy `model.generate` of one prompt."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy_config(n))
    return out[0, len(prompt):].tolist()


def _run_engine(model, wl: Workload, drive: bool) -> RunResult:
    """rollout's `RolloutEngine` (what a trainer holds, built before the clock starts): requests through its
    manager, each with its own max_new_tokens, greedy, logprobs returned. `drive=True` collects them as
    `RolloutEngine.generate` does (the caller's thread steps the engine); `drive=False` waits while the manager's
    background thread steps (the engine loop of
    a server, and what `generate` did before)."""
    from rollout import ContinuousBatchingConfig, RolloutEngine
    from rollout.engine.collect import collect

    engine = RolloutEngine(model, config=ContinuousBatchingConfig(), generation_config=greedy_config())
    t0 = time.perf_counter()  # NOTE: a trainer builds its engine once; vLLM's start-up is not timed either
    try:
        manager = engine.manager
        if drive:
            with manager.driving():
                rids = [manager.add_request(p, request_id=f"req_{i}", max_new_tokens=n, temperature=0.0)
                        for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
                outs = collect(manager, rids)
        else:
            rids = [manager.add_request(p, request_id=f"req_{i}", max_new_tokens=n, temperature=0.0)
                    for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
            got = {}
            while len(got) < len(rids):
                out = manager.get_result(timeout=60.0)
                got[out.request_id] = out
            outs = [got[r] for r in rids]
        dt = time.perf_counter() - t0
        st = engine.cache_stats()
    finally:
        engine.close()
    body = st["computed_prompt_tokens"] + st["generated_tokens"] - len(rids)
    return RunResult("engine" if drive else "engine_thread", dt, [o.generated_tokens for o in outs], body,
                     st["generated_tokens"], dict(cached_prompt_tokens=st["cached_prompt_tokens"]))


def run_engine(model, wl: Workload) -> RunResult:
    return _run_engine(model, wl, drive=True)


def run_engine_thread(model, wl: Workload) -> RunResult:
    return _run_engine(model, wl, drive=False)


VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python")


def vllm_available() -> bool:
    return os.path.exists(VLLM_PYTHON)


def run_vllm(model, wl: Workload) -> RunResult:
    """vLLM's CPU build in its own venv and process (benchmarks/vllm_cpu.py) on a `save_pretrained` copy of
    `model` (saved once per model), same requests, greedy, EOS ignored; the time is its `generate` call
    alone (engine start-up and compile warm-up excluded), with the same torch thread count as this process."""
    import json
    import subprocess
    import tempfile

    saved = getattr(model, "_vllm_dir", None)
    if saved is None:
        saved = tempfile.mkdtemp(prefix="vllm_model_")
        model.save_pretrained(saved)
        model._vllm_dir = saved
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[next(model.parameters()).dtype]
    with tempfile.TemporaryDirectory() as d:
        job = os.path.join(d, "in.json")
        res = os.path.join(d, "out.json")
        with open(job, "w") as f:
            json.dump(dict(model=saved, dtype=dtype, threads=torch.get_num_threads(), prompts=wl.prompts,
                           max_new=wl.max_new, warmup=[p[:16] for p in wl.prompts[:4]]), f)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cpu.py")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([VLLM_PYTHON, script, job, res], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM-CPU failed ({proc.returncode}): {proc.stderr[-2000:]}")
        with open(res) as f:
            out = json.load(f)
    return RunResult("vllm", out["seconds"], [o[:n] for o, n in zip(out["outputs"], wl.max_new, strict=True)],
                     extra=dict(init_seconds=out["init_seconds"], cpu_timed=out.get("cpu_seconds")))


SYSTEMS = {"ours": run_ours, "hf_cb": run_hf_cb, "generate": run_generate, "engine": run_engine,
           "engine_thread": run_engine_thread, "vllm": run_vllm}
LABELS = {"ours": "ours (rollout, default config)", "hf_cb": "transformers CB (tuned)",
          "generate": "HF generate (padded)", "engine": "ours: RolloutEngine (caller steps)",
          "engine_thread": "ours: RolloutEngine (engine thread)", "vllm": "vLLM-CPU (own process)"}


def training_step(model, steps: int = 1, batch: int = 8, length: int = 128, seed: int = 0) -> float:
    """What a trainer's process has done before it generates: deep-copy the policy and run `steps` training
    steps (forward, backward, AdamW step) on random tokens on this (the main) thread; returns seconds."""
    t0 = time.perf_counter()
    policy = copy.deepcopy(model).float().train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, policy.config.vocab_size, (batch, length), generator=g)
        loss = policy(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    del policy, opt
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------- measurement


def compare(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of requests whose tokens are identical, mean share of each request's tokens before the first
    difference)."""
    exact = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    prefix = []
    for x, y in zip(a, b, strict=True):
        k = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
        prefix.append(k / max(len(x), 1))
    return exact, statistics.mean(prefix)


@torch.no_grad()
def divergence_margins(model, wl: Workload, a: list[list[int]], b: list[list[int]], limit: int = 16) -> dict | None:
    """Where two greedy outputs first differ, how close was the call? Re-scores the common prefix with an fp32
    copy of the same weights and returns the logit gaps |l[a_tok] - l[b_tok]| (near 0 = a near-tie that two
    correct kernels may break differently in low precision) next to the typical top-1 - top-2 gap."""
    diverged = [i for i in range(len(a)) if a[i] != b[i]][:limit]
    if not diverged:
        return None
    ref = copy.deepcopy(model).float() if next(model.parameters()).dtype != torch.float32 else model
    gaps, top_gaps, prefers_a = [], [], 0
    for i in diverged:
        t = next(k for k, (u, v) in enumerate(zip(a[i], b[i], strict=False)) if u != v)
        ids = torch.tensor([wl.prompts[i] + a[i][:t]])
        all_logits = ref(ids).logits[0].float()  # [len, V]
        logits = all_logits[-1]
        gaps.append(abs(float(logits[a[i][t]] - logits[b[i][t]])))
        top2 = all_logits.topk(2, dim=-1).values
        top_gaps.append(float((top2[:, 0] - top2[:, 1]).median()))  # typical margin along this sequence
        prefers_a += int(logits[a[i][t]] >= logits[b[i][t]])
    if ref is not model:
        del ref
    return dict(n=len(diverged), gap_median=statistics.median(gaps), gap_max=max(gaps),
                top2_gap_median=statistics.median(top_gaps), fp32_prefers_first=prefers_a)


@torch.no_grad()
def fp32_greedy_agreement(model, wl: Workload, outputs: list[list[int]], ref=None) -> dict:
    """Teacher-force each completion through an fp32 copy of the same weights: the share of generated tokens
    that are the fp32 argmax given the system's own prefix, and the fp32 logit gap (argmax - chosen) where
    they are not. A low-precision engine that is greedy up to near-ties scores close to 1 with small gaps."""
    ref = ref if ref is not None else (copy.deepcopy(model).float()
                                       if next(model.parameters()).dtype != torch.float32 else model)
    agree = total = 0
    gaps: list[float] = []
    for prompt, out in zip(wl.prompts, outputs, strict=True):
        ids = torch.tensor([prompt + out])
        logits = ref(ids, logits_to_keep=len(out) + 1).logits[0, :-1].float()  # [len(out), V]
        chosen = torch.tensor(out)
        best = logits.argmax(-1)
        ok = best == chosen
        agree += int(ok.sum())
        total += len(out)
        if not bool(ok.all()):
            bad = (~ok).nonzero()[:, 0]
            gaps += (logits[bad, best[bad]] - logits[bad, chosen[bad]]).tolist()
    return dict(agree=agree / max(total, 1), tokens=total, n_off=len(gaps),
                gap_median=statistics.median(gaps) if gaps else 0.0, gap_max=max(gaps) if gaps else 0.0)


def useful_matmul_flops(wl: Workload, body_params: int, head_params: int) -> int:
    """2 x (body matmul params x (prompt + completion - 1) tokens per request + head params x completion
    tokens): the matmul work of the useful tokens, as if no prefix were shared and nothing padded."""
    body_tokens = sum(len(p) + n - 1 for p, n in zip(wl.prompts, wl.max_new, strict=True))
    return 2 * (body_params * body_tokens + head_params * wl.useful_tokens)


def matmul_peak(dtype: torch.dtype, n: int = 2048, min_seconds: float = 1.0) -> tuple[float, float]:
    """Best FLOP/s of `torch.matmul` on n x n x n over repeated calls (2 n^3 FLOP each):
    (by wall clock, by process CPU time)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)
    best_wall = best_cpu = 0.0
    total, t_start = 0, time.perf_counter()
    while time.perf_counter() - t_start < min_seconds or total < 3:
        t0, c0 = time.perf_counter(), time.process_time()
        torch.matmul(a, b)
        best_wall = max(best_wall, 2 * n**3 / (time.perf_counter() - t0))
        best_cpu = max(best_cpu, 2 * n**3 / max(time.process_time() - c0, 1e-9))
        total += 1
    return best_wall, best_cpu


def rollout_version(repo: str | None = None) -> str:
    """The live `rollout` package: its path, the HEAD commit and whether rollout/ has uncommitted changes."""
    import subprocess

    import rollout

    repo = repo or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--", "rollout"], capture_output=True,
                               text=True).stdout.strip()
    except Exception:
        head, dirty = "?", ""
    return f"{os.path.dirname(rollout.__file__)} at {head}{' + uncommitted changes' if dirty else ''}"


def machine_info() -> str:
    model_name, cores = "?", "?"
    try:
        import subprocess

        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        model_name = info.get("Model name", "?").strip()
        cores = info.get("CPU(s)", "?").strip()
    except Exception:
        pass
    return f"{model_name}, {cores} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads)"
