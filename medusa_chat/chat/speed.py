"""How much faster the replies are: measured against plain decoding on a fixed prompt (`measure_baseline`), or
estimated from tokens per step and the tree step's cost from this device's calibration."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from medusa_chat.errors import MedusaChatError
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.tree import Tree

if TYPE_CHECKING:
    import threading

    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.model.sources.loading import LoadedModel

# The fixed prompt of `measure_baseline`: asks for a long answer so the measurement is not cut short by EOS.
BASELINE_PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."
BASELINE_TOKENS = 48

# Per-process cache of measured plain-decoding speeds, keyed by (model, device, dtype, quant): a second
# session on the same model (e.g. the web UI opening a new chat) reuses the measurement.
MEASURED_BASELINES: dict[tuple[str, str, str, str], float] = {}


class SpeedMeter:
    """How much faster a session's replies are; SessionManager holds one (`session.speed`)."""

    def __init__(self) -> None:
        self.baseline_tokens_per_s: float | None = None
        # This device's calibrated step latency by tree size: read when the tree or the calibration changes,
        # not per step (the speedup is shown while a reply streams).
        self.latency_by_size: dict[int, float] = {}

    def read_latencies(self, loaded: LoadedModel | None) -> None:
        """{tree size: step latency} from this device's cached calibration ({} when none)."""
        from medusa_chat.tuning.tree_choice import load_calibration, model_identity

        try:
            cal = load_calibration(*model_identity(loaded))
            self.latency_by_size = {int(row["size"]): float(row["latency_s"]) for row in (cal or {}).get("sizes", [])}
        except Exception:  # noqa: BLE001 - a calibration is an optional hint; never let it break a load
            self.latency_by_size = {}

    def speedup(self, tokens_per_s: float, tokens_per_step: float, tree_size: int | None) -> tuple[float, str]:
        """(speedup, "measured" | "estimated"): measured against plain decoding when `measure_baseline` ran
        for this model/device, else estimated as tokens per step divided by the tree step's relative cost
        when this device was calibrated (else tokens per step alone). `tree_size`: the engine's (None: no engine)."""
        if self.baseline_tokens_per_s and tokens_per_s > 0:
            return tokens_per_s / self.baseline_tokens_per_s, "measured"
        return tokens_per_step / self._step_cost_ratio(tree_size), "estimated"

    def _step_cost_ratio(self, size: int | None) -> float:
        """How much a step of the current tree costs relative to a one-token step, from this device's
        calibration (`medusa-chat calibrate`, read when the tree was chosen); 1.0 when unknown. On a CPU a
        64-node step can cost 3x a plain one, so tokens/step alone would promise a speedup that is not there."""
        if size is None:
            return 1.0
        sizes = self.latency_by_size
        if 1 not in sizes or size not in sizes or sizes[1] <= 0:
            return 1.0
        return max(sizes[size] / sizes[1], 1e-6)

    def recall_baseline(self, loaded: LoadedModel) -> None:
        """This process' measured plain-decoding speed for the model, where one was measured."""
        self.baseline_tokens_per_s = MEASURED_BASELINES.get(_baseline_key(loaded))

    def measure_baseline(
        self, engine: MedusaEngine, loaded: LoadedModel, stop: threading.Event, max_new_tokens: int = BASELINE_TOKENS
    ) -> float:
        """Plain decoding speed (root-only tree, one token per step, greedy) on a fixed prompt; stored so
        later speedups are "measured". Leaves the conversation untouched (the caller holds the reply lock)."""
        tree = engine.tree
        prompt = loaded.build_prompt([{"role": "user", "content": BASELINE_PROMPT}])
        settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0)
        stop.clear()
        summary: ReplySummary | None = None
        try:
            engine.set_tree(Tree.chain(0))
            for item in engine.generate(prompt, settings, stop):
                if isinstance(item, ReplySummary):
                    summary = item
        except BaseException:  # Ctrl-C included: a step may have died half-way through the cache
            with contextlib.suppress(Exception):
                engine.reset()
            raise
        finally:
            engine.set_tree(tree)
        if summary is None or summary.decode_tokens_per_s <= 0:
            raise MedusaChatError("the baseline reply was too short to measure; try again")
        self.baseline_tokens_per_s = summary.decode_tokens_per_s
        MEASURED_BASELINES[_baseline_key(loaded)] = self.baseline_tokens_per_s
        return self.baseline_tokens_per_s


def _baseline_key(loaded: LoadedModel) -> tuple[str, str, str, str]:
    return (loaded.spec.name, str(loaded.device), str(loaded.dtype), loaded.quant)
