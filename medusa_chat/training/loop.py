"""What the heads' and the EAGLE draft's training runs share: the learning-rate schedule, the progress display,
the resumable checkpoint with the run's state (step, best epoch), and fitting the schedule to a time budget."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from medusa_chat.training.store import Log, atomic_torch_save


@dataclass
class WarmupCosine:
    """The learning-rate factor: linear warm-up over the first steps, then a cosine to 0 at `total`. A time
    budget may shorten `total` during training; the warm-up stays as planned."""

    total: int
    warmup: int

    @classmethod
    def planned(cls, total: int, warmup_frac: float) -> WarmupCosine:
        total = max(1, total)
        return cls(total, max(1, int(warmup_frac * total)))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        frac = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1 + math.cos(math.pi * frac))


@dataclass
class RunOptions:
    """How one training run goes, beside what it trains and with which settings: the device, the resumable
    checkpoint (and whether to resume from it), the time budget, the log, and a simulated interruption after
    `stop_after_steps` (tests). The heads' and the EAGLE draft's runs take the same options."""

    device: torch.device
    checkpoint: Path | None = None
    resume: bool = False
    deadline: float | None = None
    log: Log = print
    stop_after_steps: int | None = None


def set_learning_rate(opt: torch.optim.Optimizer, lr: float) -> None:
    """The schedule is set by hand each step: it survives resumes and a shortened plan."""
    for group in opt.param_groups:
        group["lr"] = lr


class Progress:
    """A rich progress bar on a terminal; periodic log lines otherwise (logs of long runs stay readable)."""

    def __init__(self, total: int, desc: str, log: Log, every_s: float = 20.0) -> None:
        self.total, self.desc, self.log, self.every_s = total, desc, log, every_s
        self.last = time.time()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from rich.progress import (
                    BarColumn,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                from rich.progress import Progress as RichProgress

                self.bar = RichProgress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                    TextColumn("{task.fields[info]}"),
                )
                self.bar.start()
                self.task = self.bar.add_task(desc, total=total, info="")
            except ImportError:
                self.bar = None

    def update(self, done: int, info: str, total: int | None = None) -> None:
        if total is not None:
            self.total = total
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=self.total, info=info)
        elif time.time() - self.last >= self.every_s or done >= self.total:
            self.last = time.time()
            self.log(f"{self.desc} {done}/{self.total} {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@dataclass
class RunState:
    """Where a training run is, besides its weights and optimizer: the step and the best epoch so far."""

    step: int = 0
    best_loss: float = math.inf
    best_epoch: int | None = None
    epoch_losses: list[float] = field(default_factory=list)
    best: dict[str, torch.Tensor] | None = None  # the best epoch's weights

    def score_epoch(self, loss: float, epoch: int, module: nn.Module, ndigits: int | None = None) -> None:
        """An epoch's held-out loss (kept rounded to `ndigits` where given); the weights are copied when it is
        the best yet."""
        self.epoch_losses.append(loss if ndigits is None else round(loss, ndigits))
        if loss < self.best_loss:
            self.best_loss, self.best_epoch = loss, epoch
            self.best = {k: v.detach().clone() for k, v in module.state_dict().items()}


@dataclass
class Checkpoint:
    """A run's checkpoint file: the weights, the optimizer, the schedule's length and the RunState, under a key
    of the settings and the data (a checkpoint made for others is not resumed)."""

    path: Path | None
    key: dict[str, Any]
    module: nn.Module
    opt: torch.optim.Optimizer
    plan: WarmupCosine
    weights_name: str  # the file's key for the weights ("heads", "draft")
    best_name: str  # and for the best epoch's weights ("best_state", "best")

    def resume(self, device: torch.device, log: Log, what: str) -> RunState:
        """The saved run's state, its weights and optimizer loaded; a fresh RunState where there is none."""
        if self.path is None or not self.path.is_file():
            return RunState()
        ck = torch.load(self.path, weights_only=True, map_location=device)
        if ck["key"] != self.key:
            log("checkpoint is for other settings or data: training from scratch")
            return RunState()
        self.module.load_state_dict(ck[self.weights_name])
        self.opt.load_state_dict(ck["opt"])
        self.plan.total = int(ck["total"])
        state = RunState(
            int(ck["step"]), float(ck["best_loss"]), ck["best_epoch"], list(ck["epoch_losses"]), ck.get(self.best_name)
        )
        log(f"resuming {what} at step {state.step}/{self.plan.total}")
        return state

    def save(self, state: RunState) -> None:
        if self.path is None:
            return
        atomic_torch_save(
            {
                "key": self.key,
                self.weights_name: self.module.state_dict(),
                "opt": self.opt.state_dict(),
                "step": state.step,
                "total": self.plan.total,
                "best_loss": state.best_loss,
                "best_epoch": state.best_epoch,
                "epoch_losses": state.epoch_losses,
                self.best_name: state.best,
            },
            self.path,
        )


@dataclass
class DeadlineFit:
    """Shortens the schedule so that its cosine decay still ends by the deadline. The steps from `start` to `end`
    are timed (after a warm-up) and the plan keeps what fits in 92% of the time left; the check repeats every
    `end - start` steps at the rate since the previous one, so steps that slow down later (a busier machine, the
    held-out passes at epoch ends) shorten the plan again rather than run past the deadline mid-decay."""

    deadline: float | None
    start: int
    end: int
    per_step_text: Callable[[float], str]  # seconds per step as the log line writes them
    window_start: float | None = None  # when the current timing window began (None: not yet timed)
    window_step: int = 0  # the step it began at

    def after_step(self, step: int, plan: WarmupCosine, log: Log) -> None:
        if step == self.start:
            self.window_start, self.window_step = time.time(), step
            return
        window = self.end - self.start
        if self.deadline is None or self.window_start is None or step < self.end or (step - self.end) % window:
            return
        now = time.time()
        per = (now - self.window_start) / (step - self.window_step)
        self.window_start, self.window_step = now, step
        fit = int((self.deadline - now) / per * 0.92)
        if step + fit < plan.total:
            plan.total = max(step + 1, step + fit)
            log(f"time budget: training shortened to {plan.total} steps ({self.per_step_text(per)})")

    def passed(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline


class RunningTop1:
    """Each head's (or unroll step's) training top-1 as an exponential moving average, bias-corrected as Adam's
    moments are: a warm-started run shows the trained draft's accuracy from its first steps, not a ramp up from
    zero. A step that counted no target for an entry (None) leaves that entry as it was."""

    def __init__(self, n: int, decay: float) -> None:
        self.decay = decay
        self.sums = [0.0] * n
        self.weights = [0.0] * n

    def update(self, accuracies: list[float | None]) -> None:
        for i, a in enumerate(accuracies):
            if a is not None:
                self.sums[i] = self.decay * self.sums[i] + (1 - self.decay) * a
                self.weights[i] = self.decay * self.weights[i] + (1 - self.decay)

    @property
    def values(self) -> list[float]:
        return [s / w if w else 0.0 for s, w in zip(self.sums, self.weights, strict=True)]

    def __str__(self) -> str:
        return " ".join(f"{a:.2f}" for a in self.values)


@dataclass
class TrainResult:
    """What a training run did (both trainers: heads and EAGLE drafts), for its report."""

    steps: int
    total_steps: int
    seconds: float
    stopped_early: bool
    bf16: bool
    train_top1: list[float] = field(default_factory=list)
    best_epoch: int | None = None
    epoch_heldout_loss: list[float] = field(default_factory=list)
