"""Per-step metric sinks of the trainers: `metrics.jsonl`, a compact stdout line, the user's
`accelerate` trackers and a tqdm bar over steps. Only the main process writes."""

from __future__ import annotations

import json
import math
import os

from tqdm.auto import tqdm

# NOTE: the fields of the compact stdout line, in order, with their formats; absent ones are skipped.
LINE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward_mean", "reward", "{:.3f}"),
    ("reward_std", "±", "{:.3f}"),
    ("loss", "loss", "{:+.4f}"),
    ("kl", "kl", "{:.4f}"),
    ("value_loss", "vf", "{:.4f}"),
    ("entropy", "ent", "{:.3f}"),
    ("clip_fraction", "clip", "{:.3f}"),
    ("response_length", "len", "{:.1f}"),
    ("logprob_mismatch_max", "mismatch", "{:.1e}"),
    ("rollout_tokens_per_s", "tok/s", "{:.0f}"),
    ("time_generate", "gen", "{:.2f}s"),
    ("time_train", "train", "{:.2f}s"),
    ("time_sync", "sync", "{:.3f}s"),
)


def format_line(metrics: dict[str, float], max_steps: int | None = None) -> str:
    """`step 3/10 reward 0.412 ± 0.210 loss -0.0123 ...`"""
    head = f"step {metrics.get('step', '?')}" + (f"/{max_steps}" if max_steps else "")
    parts = [head]
    for key, label, fmt in LINE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " ".join(parts)


class MetricsLogger:
    """Writes one record per step.

    Args:
        accelerator: its `is_main_process` picks the writer; `accelerator.log` feeds its trackers.
        output_dir: `metrics.jsonl` is appended there (created if missing).
        max_steps: the progress bar's total.
        stdout: print a compact line per step; progress: show a tqdm bar with the reward.
        desc: the bar's label.
    """

    def __init__(
        self,
        accelerator,
        output_dir: str,
        max_steps: int,
        stdout: bool = True,
        progress: bool = True,
        desc: str = "rl",
    ) -> None:
        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.max_steps = max_steps
        self.stdout, self.progress, self.desc = stdout, progress, desc
        self._bar = None
        if self.main:
            os.makedirs(output_dir, exist_ok=True)

    def log(self, metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        self.accelerator.log(metrics, step=step)  # NOTE: a no-op without trackers; main process only
        if not self.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in metrics.items()}) + "\n")
        bar = self.start(step - 1)
        if self.stdout:
            line = format_line(metrics, self.max_steps)
            bar.write(line) if bar is not None else print(line, flush=True)
        if bar is not None:
            bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}", refresh=False)
            bar.update(1)

    def start(self, done: int = 0):
        """Open the progress bar (main process, once) at `done` steps; returns it or None."""
        if self.main and self.progress and self._bar is None:
            self._bar = tqdm(
                total=self.max_steps, initial=done, desc=self.desc, unit="step", dynamic_ncols=True
            )
        return self._bar

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value
