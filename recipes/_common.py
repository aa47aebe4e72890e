"""Helpers the recipes share: the embedded warm-started model, dataset loading, the reward
registry, and the outputs every recipe writes (plot, summary).

The recipes themselves stay flat and readable top to bottom; everything here is a plain function.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence

import torch
from _tp import tp_load_kwargs
from accelerate import Accelerator
from datasets import Dataset, load_dataset, load_from_disk
from transformers.utils import logging as hf_logging

from rollout import ContinuousBatchingConfig
from trainers.base import checkpoints
from trainers.tasks import (
    AdditionTask,
    addition_reward,
    build_tiny_model,
    greedy_accuracy,
    make_addition_tokenizer,
)
from trainers.verifiers import math_reward
from trainers.warm_start import sft_warm_start

# NOTE: a recipe's output is its own progress bar and summary lines. peft reads transformers' deprecated
# `is_gradient_checkpointing` on every get_peft_model / from_pretrained (a FutureWarning per call, nothing a user
# can act on), and transformers draws a bar for every checkpoint it writes or loads.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
hf_logging.disable_progress_bar()

# NOTE: the embedded GRPO warm start (recipes/grpo.py and recipes/trl_grpo.py load the same checkpoint).
# It has its own seed: SFT on this task learns through a sudden transition whose step varies with the seed
# (seed 0: ~step 450; seed 1: past 1000), so `--seed` varies the RL run on one fixed, partly trained
# policy. See trainers.warm_start.sft_warm_start.
GRPO_WARM_START = dict(target_exact=0.3, max_sft_steps=1000, seed=0)
# NOTE: warm starts are built once per machine, here, and copied to each run's OUTPUT_DIR/init (the first recipe
# run pays the warm start; every later one, whatever its --output_dir, reuses it). A cache entry is keyed by every
# setting that changes the checkpoint (seed, target, steps, band, rule version, model size) and by the torch and
# transformers versions (the SFT transition moves between releases), so a run is served only a warm start its own
# settings and libraries would build. An entry is built in a temporary directory and renamed into place whole.
WARM_START_CACHE = "~/.cache/rollout/warm_starts"  # NOTE: ROLLOUT_WARM_START_CACHE moves it; deleting it is safe
WARM_START_BAND = 0.05  # the warm start lands within target_exact +- this (trainers.warm_start.sft_warm_start)
WARM_START_VERSION = 2  # NOTE: bumped with the stop rule, so a cache an older rule built is not reused
# NOTE: the embedded sequences are ~15 tokens: small pages, and a cache sized to the batch, not to memory.
GRPO_EMBEDDED_ENGINE = ContinuousBatchingConfig(page_size=16, num_blocks=1024, max_batch_tokens=2048)

# ------------------------------------------------------------------------------------ accelerate


def make_accelerator(bf16: bool = False, report_to: Sequence[str] | None = None, **kwargs) -> Accelerator:
    """An `Accelerator` that really runs several ranks on CPU: without `cpu=True`, a
    `--multi_gpu --num_processes 2` launch on a machine with no CUDA gives two lone processes.

    `bf16` trains under bf16 autocast (weights and optimizer stay fp32); `report_to` names
    accelerate trackers ("tensorboard", "wandb", "trackio", ...), each installed separately."""
    return Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision="bf16" if bf16 else "no",
        log_with=list(report_to) if report_to else None,
        **kwargs,
    )


def add_run_args(p) -> None:
    """The flags the recipes share for real models, real datasets and long runs."""
    p.add_argument("--dataset_config", default=None, help="dataset config name, e.g. 'main' for openai/gsm8k")
    p.add_argument("--prompt_column", default="prompt", help="the column holding prompts (text or chat messages)")
    p.add_argument("--answer_column", default="answer", help="the column the reward reads as `answer`")
    p.add_argument("--chat_template", action="store_true", help="apply the tokenizer's chat template to text prompts")
    p.add_argument("--bf16", action="store_true", help="train under bf16 autocast")
    p.add_argument("--batch_invariant", action="store_true",
                   help="batch-invariant engine and trainer passes: rollout logprobs == trainer's, bit for bit "
                        "(with --bf16 the engine and those passes run in bf16)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--engine_memory_fraction", type=float, default=0.3,
                   help="share of free GPU memory the engine's KV cache takes (colocated with training)")
    p.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0 = never)")
    p.add_argument("--save_total_limit", type=int, default=None, help="keep only the newest N checkpoints")
    p.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint dir, or 'latest' in output_dir")
    p.add_argument("--report_to", nargs="*", default=None, help="accelerate trackers: tensorboard wandb trackio ...")


def trainer_run_kwargs(args) -> dict:
    """The `RLConfig` fields set by `add_run_args` flags."""
    return dict(
        chat_template=args.chat_template,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        engine_memory_fraction=args.engine_memory_fraction,
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        batch_invariant=args.batch_invariant,
    )


def add_async_args(p) -> None:
    """Asynchronous rollouts (GRPO, `trainers.async_rollout`)."""
    p.add_argument("--async_rollout", action="store_true",
                   help="generate the next steps' groups on a producer thread while the learner trains")
    p.add_argument("--max_staleness", type=int, default=1, help="most policy versions generation runs ahead")
    p.add_argument("--stale_tis_cap", type=float, default=2.0, help="cap of the importance weight of stale tokens")
    p.add_argument("--rollout_threads", type=int, default=None, help="torch threads of the producer thread")
    p.add_argument("--learner_threads", type=int, default=None, help="torch threads of the learner thread")


def async_run_kwargs(args) -> dict:
    """The `GRPOConfig` fields set by `add_async_args` flags."""
    return dict(async_rollout=args.async_rollout, max_staleness=args.max_staleness, stale_tis_cap=args.stale_tis_cap,
                rollout_threads=args.rollout_threads, learner_threads=args.learner_threads)


def run_engine_dtype(args) -> str | None:
    """`--engine_dtype`; with `--bf16 --batch_invariant` and none given, "bfloat16" (the mode runs one dtype:
    the engine's bf16 copy, and the trainer's passes on bf16 casts of its fp32 weights)."""
    if args.engine_dtype is None and args.bf16 and args.batch_invariant:
        return "bfloat16"
    return args.engine_dtype


def resolve_checkpoint(output_dir: str, spec: str | None) -> str | None:
    """`--resume_from_checkpoint`: None, a checkpoint directory, or "latest" (the newest
    `checkpoint-N` under `output_dir`, None when there is none yet)."""
    if spec is None:
        return None
    if spec == "latest":
        found = checkpoints(output_dir)
        return found[-1] if found else None
    if not os.path.isdir(spec):
        raise ValueError(f"--resume_from_checkpoint: {spec} is not a directory")
    return spec


def checkpoint_step(path: str) -> int:
    with open(os.path.join(path, "trainer_state.json")) as f:
        return int(json.load(f)["step"])


def read_metrics(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------- rewards


def exact_match_reward(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_
) -> list[float]:
    """1.0 when the completion's first line, stripped, equals the `answer` column, else 0.0."""
    lines = [(c.strip().splitlines() or [""])[0].strip() for c in completions]
    return [float(line == str(a).strip()) for line, a in zip(lines, answer, strict=True)]


# NOTE: every reward is `(prompts, completions, **dataset_columns) -> list[float]` in [0, 1];
# a completion counts as correct (for pass@k) when its reward is 1.
REWARDS: dict[str, Callable[..., Sequence[float]]] = {
    "addition": addition_reward,  # exact verifier with per-digit partial credit (trainers.tasks)
    "exact_match": exact_match_reward,
    "math": math_reward,  # final answer (#### N, \\boxed{}, last number) of both sides (trainers.verifiers)
}


def get_reward(name: str) -> Callable[..., Sequence[float]]:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; valid: {sorted(REWARDS)}") from None


# -------------------------------------------------------------------------------------- datasets

# file suffix -> `datasets` builder name
DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_prompts(
    spec: str,
    split: str = "train",
    config_name: str | None = None,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
) -> Dataset:
    """A `datasets.Dataset` from a local file (json / jsonl / parquet / csv), a `save_to_disk`
    directory, a directory of such files, or a hub id (with its `config_name`, e.g. "main").
    `prompt_column` is renamed "prompt" and `answer_column` "answer" (what the rewards read)."""
    if os.path.isdir(spec) and os.path.exists(os.path.join(spec, "dataset_info.json")):
        data = load_from_disk(spec)
        if hasattr(data, "keys"):  # a saved DatasetDict
            data = data[split]
    elif os.path.isfile(spec):
        suffix = os.path.splitext(spec)[1].lower()
        if suffix not in DATA_BUILDERS:
            raise ValueError(f"{spec}: unsupported file type {suffix!r}; use one of {sorted(DATA_BUILDERS)}")
        data = load_dataset(DATA_BUILDERS[suffix], data_files=spec, split="train")
    else:  # a directory of data files or a hub id
        data = load_dataset(spec, config_name, split=split)
    for column, target in ((prompt_column, "prompt"), (answer_column, "answer")):
        if column == target:
            continue
        if column not in data.column_names:
            raise ValueError(f"{spec}: no column {column!r} ({target}_column); has {data.column_names}")
        if target in data.column_names:
            data = data.remove_columns(target)
        data = data.rename_column(column, target)
    if "prompt" not in data.column_names:
        raise ValueError(
            f"{spec}: the dataset needs a 'prompt' column (or --prompt_column), has {data.column_names}"
        )
    return data


def write_jsonl(rows: Sequence[dict], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


# ------------------------------------------------------------------------- the embedded model

WARM_START_FILE = "warm_start.json"  # the settings, versions and held-out greedy accuracy of a saved warm start
HELDOUT_PROBLEMS = 512  # the recipes' held-out greedy accuracy before and after RL (recipes/grpo.py HELDOUT)


def build_warm_start(
    path: str,
    seed: int = 0,
    target_exact: float = 0.3,
    max_sft_steps: int = 1000,
    hidden_size: int = 128,
    num_layers: int = 3,
    band: float = WARM_START_BAND,
    version: int = WARM_START_VERSION,
) -> str:
    """Build the embedded addition model from scratch, warm-start it by SFT until greedy exact
    match reaches `target_exact` (a partly trained policy leaves RL room to improve), and
    `save_pretrained` model and tokenizer to `path`. Returns `path`."""
    tokenizer = make_addition_tokenizer()
    task = AdditionTask(num_digits=3, seed=seed)
    model = build_tiny_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    sft_warm_start(model, tokenizer, task, steps=max_sft_steps, seed=seed, target_exact=target_exact, band=band)
    # NOTE: the recipes' own held-out problems (the seed and count of their "held-out greedy exact match" before
    # RL), so the warm start is reported with one figure everywhere
    accuracy = greedy_accuracy(model, tokenizer, AdditionTask(num_digits=3), n=HELDOUT_PROBLEMS)
    print(f"warm start: held-out greedy exact {accuracy['exact']:.3f}, reward {accuracy['reward']:.3f} "
          f"({HELDOUT_PROBLEMS} problems) -> {path}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    record = warm_start_key(seed=seed, target_exact=target_exact, max_sft_steps=max_sft_steps, band=band,
                            version=version, hidden_size=hidden_size, num_layers=num_layers)
    with open(os.path.join(path, WARM_START_FILE), "w") as f:
        json.dump({**record, **accuracy}, f)
    return path


def warm_start_key(seed: int, target_exact: float, max_sft_steps: int, band: float = WARM_START_BAND,
                   version: int = WARM_START_VERSION, hidden_size: int = 128, num_layers: int = 3) -> dict:
    """Everything a saved warm start must match to be reused: its settings, the model's size, the torch and
    transformers versions that built it, and the CPU it was built on (float rounding moves the supervised run's
    stopping step: held-out 0.309 here, 0.283 with the kernels held to AVX2). The thread count moves it too (0.305
    at two threads) but is left out: the suite's and a user's runs at other counts share one build."""
    import transformers

    return dict(seed=seed, target_exact=target_exact, max_sft_steps=max_sft_steps, band=band, version=version,
                hidden_size=hidden_size, num_layers=num_layers, torch=torch.__version__,
                transformers=transformers.__version__, cpu=cpu_name())


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo's first `model name`), else `platform.processor()` or 'unknown'."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def warm_start_cache_dir(seed: int, target_exact: float, max_sft_steps: int, band: float = WARM_START_BAND,
                         version: int = WARM_START_VERSION, hidden_size: int = 128, num_layers: int = 3) -> str:
    """Where the shared cache keeps the embedded addition model warm-started with these settings, by these
    torch and transformers versions, on this CPU (`warm_start_key`)."""
    key = warm_start_key(seed, target_exact, max_sft_steps, band, version, hidden_size, num_layers)
    root = os.path.expanduser(os.environ.get("ROLLOUT_WARM_START_CACHE", WARM_START_CACHE))
    machine = hashlib.sha1(key["cpu"].encode()).hexdigest()[:8]  # NOTE: a CPU's name has spaces, @ and (R)
    name = (f"addition3_v{version}_seed{seed}_target{target_exact:g}_steps{max_sft_steps}_band{band:g}"
            f"_h{hidden_size}_l{num_layers}_torch{key['torch']}_transformers{key['transformers']}"
            f"_cpu{machine}")
    return os.path.join(root, name.replace("+", "-"))


def prepare_embedded_model(accelerator: Accelerator, path: str, **warm_start) -> str:
    """Rank 0 puts the warm-started model at `path`: a checkpoint already there built with the same settings and
    library versions is kept, else one from the shared cache (`warm_start_cache_dir`, built there first when
    missing) is copied in; then every rank may load it from disk."""
    if accelerator.is_main_process:
        key = warm_start_key(**warm_start)
        if saved_settings_match(path, key):
            print(f"warm start: reusing {path}")
        else:
            cached = warm_start_cache_dir(**warm_start)
            if saved_settings_match(cached, key):
                print(f"warm start: reusing the cached {cached} (built with these settings and versions)")
            else:
                # NOTE: built beside the entry and renamed into place: a process reading the cache meanwhile
                # finds either no entry or a whole one, never a half-written one
                os.makedirs(os.path.dirname(cached), exist_ok=True)
                building = tempfile.mkdtemp(prefix=os.path.basename(cached) + ".building-",
                                            dir=os.path.dirname(cached))
                try:
                    build_warm_start(building, **warm_start)
                except BaseException:
                    shutil.rmtree(building, ignore_errors=True)
                    raise
                try:
                    os.rename(building, cached)
                except OSError:  # NOTE: another process renamed its own build there first: it has the same key
                    shutil.rmtree(building, ignore_errors=True)
            if os.path.exists(path):
                shutil.rmtree(path)  # NOTE: an init/ of other settings or versions: no stale file survives
            shutil.copytree(cached, path)
    accelerator.wait_for_everyone()
    return path


def saved_settings_match(path: str, key: dict) -> bool:
    """Whether `path` holds a warm start saved with `key`'s settings (`warm_start_key`)."""
    record = os.path.join(path, WARM_START_FILE)
    saved = json.load(open(record)) if os.path.exists(record) else {}  # noqa: SIM115 - a small file, read once
    return bool(saved) and all(saved.get(k) == v for k, v in key.items())


def load_policy_and_prompts(
    accelerator: Accelerator, args, train_prompts: int, sft_seed: int
) -> tuple[str, object, torch.nn.Module, Dataset, float]:
    """The recipes' steps 1-2: `(model_path, tokenizer, model, dataset, warm-start seconds)`.

    The policy is `args.model` (a hub id or local checkpoint) or the embedded model, warm-started
    with `sft_seed` and saved to OUTPUT_DIR/init, then loaded back with `from_pretrained` either way.
    The prompts are `args.dataset` or `train_prompts` generated addition problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model_path = args.model or prepare_embedded_model(
        accelerator,
        os.path.join(args.output_dir, "init"),
        seed=sft_seed,
        target_exact=args.sft_target,
        max_sft_steps=args.sft_steps,
    )
    warm_start_s = time.perf_counter() - start
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **tp_load_kwargs(args, model_path))
    if getattr(args, "gradient_checkpointing", False):
        # NOTE: transformers 5.24 renamed it; older releases only have the gradient_ spelling
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.dataset:
        # NOTE: getattr: a recipe without `add_run_args` (recipes/trl_grpo.py) keeps the defaults
        dataset = load_prompts(
            args.dataset,
            args.dataset_split,
            getattr(args, "dataset_config", None),
            getattr(args, "prompt_column", "prompt"),
            getattr(args, "answer_column", "answer"),
        )
    else:
        dataset = AdditionTask(num_digits=3).to_dataset(train_prompts, seed=1000 + args.seed)
    return model_path, tokenizer, model, dataset, warm_start_s


# -------------------------------------------------------------------------------------- outputs


RUN_FILE = "rollout_run.json"  # in each recipe's output directory: which recipe wrote it, with which flags
RESULTS = ("summary.json", "final", "metrics.jsonl", "sweep.csv")  # what a finished or running recipe leaves
# NOTE: flags that change where or how a run is written or resumed, not what it computes
NOT_THE_RUN = {"output_dir", "overwrite", "resume_from_checkpoint", "report_to", "save_steps", "save_total_limit"}


def add_overwrite_arg(p) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of another run (another recipe, or other flags) in --output_dir")


def run_record(recipe: str, args=None) -> dict:
    """What `claim_output_dir` keeps in `RUN_FILE`: the recipe and the flags that decide its result (all of them
    but `NOT_THE_RUN`; `args=None`: the recipe alone, for a recipe that adds to its results, the sweep)."""
    flags = {} if args is None else {k: v for k, v in sorted(vars(args).items()) if k not in NOT_THE_RUN}
    return {"recipe": recipe, "flags": json.loads(json.dumps(flags, default=str))}


def _flag_diff(theirs: dict, ours: dict) -> str:
    keys = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    return ", ".join(f"--{k} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in keys[:4]) + (
        f" (+{len(keys) - 4} more)" if len(keys) > 4 else "")


def output_dir_owner_problem(output_dir: str, record: dict, resuming: bool = False) -> str | None:
    """Why this run may not write into `output_dir` (None: it may): the directory holds the results of another
    recipe, or of the same recipe with other flags (a resumed run may change flags), or results no recipe marked."""
    if not os.path.isdir(output_dir):
        return None
    marker = os.path.join(output_dir, RUN_FILE)
    if not os.path.exists(marker):
        found = [name for name in RESULTS if os.path.exists(os.path.join(output_dir, name))]
        return f"it holds {', '.join(found)} of an earlier run that did not record its recipe" if found else None
    with open(marker) as f:
        theirs = json.load(f)
    if theirs.get("recipe") != record["recipe"]:
        return f"it holds the results of {theirs.get('recipe')}"
    if resuming or theirs.get("flags") == record["flags"]:
        return None
    return (f"it holds the results of {theirs['recipe']} run with other flags "
            f"({_flag_diff(theirs['flags'], record['flags'])})")


class Refusal(SystemExit):
    """A recipe's refusal before any work: exit status 2, its message the one line `refuse` printed."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _accelerate_launcher(pid: int) -> bool:
    """Whether process `pid` is `accelerate launch` (its `accelerate` script or `-m accelerate.commands.launch`)."""
    import psutil  # NOTE: accelerate's own dependency

    try:
        argv = psutil.Process(pid).cmdline()
    except (psutil.Error, OSError):
        return False
    script = [os.path.basename(a) for a in argv[:2]]
    return ("accelerate" in script and "launch" in argv) or "accelerate-launch" in script or (
        "accelerate.commands.launch" in argv)


def refuse(message: str) -> Refusal:
    """End the run with `message` as its one line on stderr (printed by rank 0) and exit status 2.

    `accelerate launch` answers a child's non-zero exit with a traceback of its own (`CalledProcessError`, ~20
    lines under the refusal; `-q` silences it), so under it the launcher is asked to stop first (SIGTERM, which
    it handles by stopping its children and exiting 143 without a traceback): the refusal stays one line there
    too (a multi-process launch adds torch's three warning lines as its agent stops the ranks). The line is
    written to the launcher's own stderr, not through the pipe accelerate tees a child's stderr with: a SIGTERM
    landing between that tee's read and its write dropped the line (seen in 2 of 4 runs on a loaded box). Every
    rank refuses alike; rank 0 prints and signals, the others wait to be stopped with it (a rank's own non-zero
    exit first would bring the traceback back). Raise what this returns (`raise refuse(...)`), so tests catch it
    as a SystemExit."""
    rank, launcher = int(os.environ.get("RANK", "0")), os.getppid()
    under_accelerate = _accelerate_launcher(launcher)
    if rank == 0 and not (under_accelerate and _write_to_stderr_of(launcher, message)):
        print(message, file=sys.stderr, flush=True)
    if under_accelerate:
        if rank == 0:
            os.kill(launcher, signal.SIGTERM)
        else:
            time.sleep(60)  # NOTE: the launcher stops this rank once rank 0 has signalled it
    return Refusal(message)


def _write_to_stderr_of(pid: int, message: str) -> bool:
    """Write `message` and a newline to process `pid`'s stderr (Linux: /proc/PID/fd/2); False where it cannot."""
    try:
        with open(f"/proc/{pid}/fd/2", "a") as err:  # NOTE: "a": a redirected log is not truncated
            err.write(message + "\n")
    except OSError:
        return False
    return True


def claim_output_dir(accelerator: Accelerator, output_dir: str, record: dict, overwrite: bool = False,
                     resuming: bool = False) -> None:
    """Refuse (`refuse`: one line) to write into another run's `output_dir` unless `overwrite`; else mark it as
    this run's (`RUN_FILE`). Rerunning the same command into its own directory redoes its results (the warm start
    in init/ is reused when its settings match); `--overwrite` replaces another run's, its `final/` first (a
    LoRA adapter's files left beside a full model's would make a third, broken checkpoint)."""
    problem = output_dir_owner_problem(output_dir, record, resuming)
    if problem and not overwrite:
        raise refuse(f"{record['recipe']}: refusing to write into {output_dir}: {problem}. Choose another "
                     "--output_dir, or pass --overwrite to replace those results.")
    accelerator.wait_for_everyone()  # NOTE: every rank decided on the directory as it was
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        if problem:
            shutil.rmtree(os.path.join(output_dir, "final"), ignore_errors=True)
        with open(os.path.join(output_dir, RUN_FILE), "w") as f:
            json.dump(record, f, indent=1)
    accelerator.wait_for_everyone()


def fresh_output_dir(accelerator: Accelerator, output_dir: str, resume_step: int | None = None,
                     record: dict | None = None, overwrite: bool = False) -> None:
    """Create `output_dir` (claimed for `record`'s run first, `claim_output_dir`). A new run drops the metrics of an
    earlier one (the trainer appends); a resumed run keeps them up to its checkpoint's step (later records are
    redone)."""
    if record is not None:
        claim_output_dir(accelerator, output_dir, record, overwrite, resuming=resume_step is not None)
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        metrics = os.path.join(output_dir, "metrics.jsonl")
        if resume_step is None:
            if os.path.exists(metrics):
                os.remove(metrics)
        else:
            kept = [r for r in read_metrics(output_dir) if r["step"] <= resume_step]
            write_jsonl(kept, metrics)
    accelerator.wait_for_everyone()


def smooth(values: Sequence[float], alpha: float = 0.2) -> list[float]:
    """Exponential moving average with bias correction (no lag at the start)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = alpha * v + (1 - alpha) * avg
        out.append(avg / (1 - (1 - alpha) ** i))
    return out


def plot_rewards(history: Sequence[dict], path: str, title: str = "reward") -> str:
    """`reward_mean` per step (dots and line) with its smoothed curve, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = [h for h in history if h.get("reward_mean") is not None]
    steps = [h["step"] for h in history]
    rewards = [h["reward_mean"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot(steps, rewards, "o-", color="tab:blue", alpha=0.35, markersize=3, label="reward_mean")
    ax.plot(steps, smooth(rewards), color="tab:blue", linewidth=2, label="smoothed (EMA 0.2)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.set_title(wrapped_title(title), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def summarize(history: Sequence[dict], wall_time: float, **extra) -> dict:
    """First-5 / last-5 mean reward, steps, wall time and rollout throughput of a run. A run of fewer than 10 steps
    compares its first and last halves instead (`reward_window` steps each), so the two never share a step."""
    rewards = [h["reward_mean"] for h in history if h.get("reward_mean") is not None]
    gen_time = sum(h.get("time_generate", 0.0) for h in history)
    tokens = sum(h.get("rollout_tokens_per_s", 0.0) * h.get("time_generate", 0.0) for h in history)
    window = reward_window(len(rewards))
    first5 = statistics.mean(rewards[:window]) if rewards else math.nan
    last5 = statistics.mean(rewards[-window:]) if rewards else math.nan
    return {
        "steps": len(history),
        "reward_window": window,
        "reward_first5": first5,
        "reward_last5": last5,
        "reward_rise": last5 - first5,
        "wall_time_s": wall_time,
        "rollout_tokens": tokens,
        "rollout_tokens_per_s": tokens / gen_time if gen_time > 0 else math.nan,
        "time_generate_s": gen_time,
        "time_train_s": sum(h.get("time_train", 0.0) for h in history),
        **extra,
    }


def reward_window(steps: int) -> int:
    """Steps averaged at each end of a run for "first N -> last N": 5, or half the run when it is shorter than 10."""
    return 5 if steps >= 10 else max(1, steps // 2)


def reward_span(summary: dict) -> str:
    """`reward first5 0.548 -> last5 0.771 (rise +0.222)`; a short run names its own window, and a one-step run
    has no rise to show."""
    first, last = summary["reward_first5"], summary["reward_last5"]
    if summary.get("steps", 0) < 2:
        return f"reward {first:.3f} (one step: no first and last steps to compare)"
    n = summary.get("reward_window", 5)
    return f"reward first{n} {first:.3f} -> last{n} {last:.3f} (rise {last - first:+.3f})"


def wrapped_title(title: str, width: int = 60) -> str:
    """A plot title broken into lines of at most `width` characters (a 6-inch figure clips one long line)."""
    import textwrap

    return "\n".join(textwrap.wrap(title, width)) or title


def write_json(obj: dict, path: str) -> str:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    return path
