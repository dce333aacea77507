"""How many of the tree's nodes a CPU step verifies, chosen while replies run: the prefix size with the most
expected tokens per second, its step time measured on this reply's own steps.

Why not the calibration's one choice: what an extra tree row costs on a CPU moves with the machine's state. On the
2-vCPU Zen 4 this project measures on, the same build and the same 20 Vicuna-bench prompts decoded, minutes
apart, with the plain loop at 2.52 ms a token and a 4-node step 1.77x that (4 nodes 1.05x the plain loop, 2 nodes
1.18x), then with the plain loop at 3.43 ms and a 4-node step 1.20x (4 nodes 1.54x, 2 nodes 1.40x): a busy
memory bus slows the weight stream of every step, while the extra rows' arithmetic stays what it was. A size
chosen once is right in one of those states only.

So the step time of each candidate size is measured as replies run: most steps use the current best size, and
every `explore_every` steps a neighbouring size runs `trial_steps` steps. The neighbour takes over where its
measured rate beats the current one's by `margin`; the next trial then goes on in the same direction, and after a
trial that lost, in the other (a hill climb that keeps checking both sides). Tokens per step come from
the calibration (each size's own greedy replies on built-in prompts): what a reply accepts moves with its text
(code, lists, prose), but about alike for every size, so comparing sizes by calibrated tokens per step over fresh
step times is not thrown off by the text of the moment. Greedy replies are the same tokens at every size (each
prefix of the tree is exact), so switching sizes changes speed only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from medusa_chat.tree import SizeChoices

__all__ = ["SizeChoices", "TreeSizer"]


@dataclass
class TreeSizer:
    """The prefix size for each step (`size`), from the step times it is told (`observe`). Deterministic: the
    same step times give the same sizes."""

    choices: SizeChoices
    explore_every: int = 32  # steps at the current size between two trials
    trial_steps: int = 4  # steps a trial size runs
    margin: float = 0.03  # how much faster a trial size must be to take over
    alpha: float = 0.25  # weight of a new step time in a size's running mean
    current: int = 0
    seconds: dict[int, float] = field(default_factory=dict)  # running mean step time per size
    switches: int = 0  # how often the size changed (for the record)
    _since_trial: int = 0
    _trial: int | None = None
    _trial_left: int = 0
    _trial_sum: float = 0.0
    _upward: bool = True  # the next trial's direction (kept after a win, turned after a loss)

    def __post_init__(self) -> None:
        self.choices = replace(self.choices, sizes=sorted(set(self.choices.sizes)))  # (the caller's stays as it is)
        if self.current not in self.choices.sizes:
            start = self.choices.start
            self.current = start if start in self.choices.sizes else self.choices.sizes[-1]

    def size(self) -> int:
        """The size the next step verifies."""
        if self._trial is None and self._since_trial >= self.explore_every:
            self._start_trial()
        return self._trial if self._trial is not None else self.current

    def observe(self, size: int, seconds: float) -> None:
        """A step of `size` nodes (what `size()` said) took `seconds`, its host work included."""
        if size not in self.choices.sizes or seconds <= 0:
            return
        old = self.seconds.get(size)
        self.seconds[size] = seconds if old is None else old + self.alpha * (seconds - old)
        if self._trial is None or size != self._trial:
            self._since_trial += 1
            return
        self._trial_sum += seconds
        self._trial_left -= 1
        if self._trial_left > 0:
            return
        # the trial's own mean (fresh), against the current size's running mean (its latest steps)
        trial_s = self._trial_sum / self.trial_steps
        if self.rate(self._trial, trial_s) > self.rate(self.current) * (1 + self.margin):
            self.current = self._trial  # and the next trial goes on the same way (a climb)
            self.switches += 1
        else:
            self._upward = not self._upward  # the other neighbour next time
        self._trial, self._since_trial = None, 0

    def rate(self, size: int, seconds: float | None = None) -> float:
        """Expected tokens per second of `size`: its calibrated tokens per step over its step time (measured here;
        0 where it was never timed)."""
        s = self.seconds.get(size) if seconds is None else seconds
        return self.choices.tokens_per_step.get(size, 1.0) / s if s else 0.0

    def _start_trial(self) -> None:
        sizes = self.choices.sizes
        i = sizes.index(self.current)
        below, above = sizes[i - 1] if i > 0 else None, sizes[i + 1] if i + 1 < len(sizes) else None
        first, second = (above, below) if self._upward else (below, above)
        trial = first if first is not None else second
        self._upward = trial == above
        if trial is None:  # one size only: nothing to try
            self._since_trial = 0
            return
        self._trial, self._trial_left, self._trial_sum = trial, self.trial_steps, 0.0
