"""The bench: Medusa side by side with its baselines, over a list of prompts (`medusa-chat bench`, bench/cli.py).

bench runs, for each prompt and in the same process, interleaved (the order rotates from prompt to prompt so
no method always runs on a warmer cache):

    hf      plain HF `generate` (greedy at T=0; the reference output for losslessness)
    plain   this engine's own loop with a root-only tree (one token per step): what the lean loop gains
    lookup  HF prompt-lookup decoding (`prompt_lookup_num_tokens=10`): a speculative baseline with no heads
    medusa  the engine with the Medusa tree: what speculation gains on top of the loop

Timing is the same for all four: **decode wall time**, from the moment the first new token is available (the
prefill and its token excluded) to the end of the reply, over the tokens produced after that first output.
Speedups are ratios of decode tokens per second, so different reply lengths do not distort them.
"""

from __future__ import annotations

import dataclasses
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.bench.document import document, load_average, prompt_row
from medusa_chat.bench.report import print_prompt
from medusa_chat.bench.runs import (
    DEFAULT_BASELINES,
    METHODS,
    Run,
    describe,
    run_engine,
    run_hf,
)
from medusa_chat.engine.penalties import PenaltyOptions
from medusa_chat.errors import PromptError
from medusa_chat.events import GenerationSettings
from medusa_chat.settings import GREEDY

if TYPE_CHECKING:
    from rich.console import Console

    from medusa_chat.bench.server_peers import ServerPeers
    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.tree import Tree


# ------------------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------------------
# One timed run of each method
# ------------------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------------------
# Comparing outputs
# ------------------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------------------


@dataclass
class _Totals:
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    steps_known: bool = True
    accepted: list[int] = field(default_factory=list)  # per decoding step, draft tokens accepted

    def add(self, run: Run) -> None:
        self.decode_tokens += run.decode_tokens
        self.decode_s += run.decode_s
        self.accepted.extend(run.accepted_lengths)
        if run.steps is None:
            self.steps_known = False
        else:
            self.steps += run.steps

    @property
    def tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.decode_tokens / self.steps if self.steps_known and self.steps else None

    def acceptance_by_depth(self) -> list[float] | None:
        """Per tree depth d = 1, 2, ...: the share of steps that accepted a draft token at depth d (at least d
        draft tokens); their sum plus one is the tokens per step. None for methods without trees."""
        if not self.accepted or not any(self.accepted):
            return None
        n = len(self.accepted)
        return [round(sum(1 for a in self.accepted if a >= d) / n, 4) for d in range(1, max(self.accepted) + 1)]


def _bench_settings() -> GenerationSettings:
    """The bench's reply settings when none are given: its own defaults (settings.OPTIONS)."""
    return GenerationSettings.for_entry("bench")


@dataclass
class BenchConfig:
    # every method's reply settings (the Medusa run's; a method's own length and context lookup over them)
    settings: GenerationSettings = field(default_factory=_bench_settings)
    baselines: list[str] = field(default_factory=lambda: list(DEFAULT_BASELINES))
    warmup: int = 1
    tree_sizes: list[int] | None = None
    compare_heads: list[str] | None = None  # other heads or drafts on the same backbone, side by side
    llamacpp_bench: str | None = None
    llama_server: str | None = None  # llamacpp-spec: llama-server's path (bench/server_peers.py)
    serve_args: list[str] | None = None  # llamacpp-spec: the model options `medusa-chat serve` is started with

    @property
    def greedy(self) -> bool:
        """Temperature 0: every method's reply is compared token by token with the reference."""
        return self.settings.accept_mode == GREEDY


def run_bench(
    loaded: Any,
    tree: Tree,
    prompts: list[str],
    config: BenchConfig,
    console: Console | None = None,
    tree_source: str = "",
) -> dict[str, Any]:
    """Run every method on every prompt, interleaved; return the JSON document (settings, one row per prompt,
    the summary)."""
    with BenchMethods(loaded, tree, config) as methods:  # closes the llamacpp-spec servers however the run ends
        ident = describe(loaded)
        load_before = load_average()
        encoded = [loaded.build_prompt([{"role": "user", "content": p}]) for p in prompts]
        for _ in range(config.warmup):  # first calls pay one-off costs (allocations, kernel selection, caches)
            for m in methods.all:
                methods.run(m, encoded[0], min(16, config.settings.max_new_tokens))
            if methods.servers is not None:
                methods.servers.warm(prompts[0], min(16, config.settings.max_new_tokens))

        tally = Tally(methods.all, methods.sizes)
        rows: list[dict[str, Any]] = []
        for i, (text, prompt_ids) in enumerate(zip(prompts, encoded, strict=True)):
            try:
                runs, peer_run = outcome = methods.run_prompt(i, prompt_ids, text)
            except PromptError as err:
                if console is not None:
                    console.print(f"[yellow]prompt {i + 1} skipped: {err}[/yellow]")
                continue
            for m, r in runs.items():
                tally.totals[m].add(r)
            row = prompt_row(methods, text, prompt_ids, outcome, ident["dtype"], tally)
            if methods.servers is not None:
                row["servers"] = methods.servers.end_prompt(methods.plain_loop_text(runs))
            rows.append(row)
            if console is not None:
                print_prompt(console, i + 1, len(prompts), row, runs)
        return document(methods, (tree, tree_source), ident, rows, tally, load_before)


def draft_method(location: str, taken: dict[str, str]) -> str:
    """The method name of a `--compare-heads` draft: `draft:` and its folder's name; a draft whose name is taken
    gets as many parent folders as it takes to tell it apart (`runs/a/draft`, then `runs/b/draft`: `draft:draft`,
    `draft:b/draft`), then a count: two drafts never share a row (they once did, and one of them was lost)."""
    parts = [p for p in location.replace("\\", "/").split("/") if p] or [location]
    for depth in range(1, len(parts) + 1):
        method = "draft:" + "/".join(parts[-depth:])
        if method not in taken:
            return method
    n = 2
    while f"{method}#{n}" in taken:
        n += 1
    return f"{method}#{n}"


class BenchMethods:
    """The methods under test and how one prompt runs through all of them: the engines (Medusa, its tree-size
    prefixes, the heads-only and plain loops), HF generate and prompt lookup, and llama.cpp where installed."""

    def __init__(self, loaded: Any, tree: Tree, config: BenchConfig) -> None:
        from medusa_chat.engine.engine import MedusaEngine, plain_tree

        self.loaded, self.config = loaded, config
        self.methods = [m for m in METHODS if m == "medusa" or m in config.baselines]
        self.hf_note = ""
        if PenaltyOptions.of(config.settings).active:  # HF generate has no windowed repeat penalty nor DRY
            dropped = [m for m in self.methods if m in ("hf", "lookup")]
            self.methods = [m for m in self.methods if m not in dropped]
            if dropped:
                self.hf_note = (f"{' and '.join(dropped)} skipped: HF generate has no DRY nor windowed repeat "
                                "penalty (the app's replies use DRY by default; --dry-multiplier 0 turns it off)")  # fmt: skip
        self.peer, self.peer_note, self.peer_runs = None, "", []
        if "llamacpp" in config.baselines:
            from medusa_chat.bench.peer import llama_bench_for

            self.peer, self.peer_note = llama_bench_for(loaded, torch.get_num_threads(), config.llamacpp_bench)
        self.servers: ServerPeers | None = None
        self.servers_note = ""
        if "llamacpp-spec" in config.baselines:
            from medusa_chat.bench.server_peers import request_options, start_server_peers

            binaries = (config.llama_server, config.llamacpp_bench)
            options = request_options(config.settings)
            self.servers, self.servers_note = start_server_peers(
                loaded, torch.get_num_threads(), config.serve_args, binaries, options
            )
        self.engines: dict[str, MedusaEngine] = {"medusa": MedusaEngine(loaded, tree)}
        if "heads" in self.methods:
            self.engines["heads"] = MedusaEngine(loaded, tree)
        if "plain" in self.methods:
            self.engines["plain"] = MedusaEngine(loaded, plain_tree())
        # The ablation's trees are prefixes of the model's whole tree when the run's tree is a prefix of it (a
        # calibrated size), so `--tree-sizes 64` still measures 64 nodes after calibration chose a few.
        default = loaded.default_tree
        whole = default if list(default.paths[: tree.size - 1]) == list(tree.paths) else tree
        self.sizes = sorted({min(n, whole.size) for n in config.tree_sizes}) if config.tree_sizes else []
        for n in self.sizes:
            self.engines[f"medusa@{n}"] = MedusaEngine(loaded, whole.prefix(n), adaptive=False)
        # Other drafters on the same backbone (heads folders, EAGLE drafts), each with its own tree cut to the
        # run's node budget: the same verification cost, so tokens per step and speed compare the drafts.
        self.drafts: dict[str, str] = {}  # method -> heads file
        for location in config.compare_heads or []:
            from medusa_chat.model.sources.loading import with_heads

            other = with_heads(loaded, location)
            method = draft_method(location, taken=self.drafts)
            own = other.default_tree
            self.engines[method] = MedusaEngine(other, own.prefix(min(tree.size, own.size)))
            self.drafts[method] = other.heads_file
        self.all = self.methods + [f"medusa@{n}" for n in self.sizes] + list(self.drafts)

    def __enter__(self) -> BenchMethods:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.servers is not None:
            self.servers.close()

    def settings_for(self, method: str, max_new: int) -> GenerationSettings:
        """The run's settings for one method: its reply length; context lookup off for the heads-only run."""
        settings = self.config.settings
        return dataclasses.replace(
            settings, max_new_tokens=max_new, context_lookup=settings.context_lookup and method != "heads"
        )

    def plain_loop_text(self, runs: dict[str, Run]) -> str | None:
        """The plain loop's reply as a server streams it (`medusa-chat serve`'s must equal it), or None
        without a plain run."""
        from medusa_chat.engine.text import StreamDecoder

        plain = runs.get("plain")
        if plain is None:
            return None
        decoder = StreamDecoder(self.loaded.tokenizer)
        return decoder.push(plain.token_ids) + decoder.flush()

    def run(self, method: str, prompt_ids: list[int], max_new: int) -> Run:
        s = self.settings_for(method, max_new)
        if method in ("hf", "lookup"):
            return run_hf(self.loaded, method, prompt_ids, s, seed=s.seed)
        return run_engine(self.engines[method], method, prompt_ids, s)

    def run_peer(self, prompt_ids: list[int]) -> dict[str, Any] | None:
        """One llama-bench run (one repetition), in the same rotation as the other methods: on a shared
        machine whose speed drifts by +-20% over minutes, a peer measured only before and after the prompts
        can land in another phase than the methods it is compared with."""
        if self.peer is None:
            return None
        try:
            self.peer_runs.append(
                self.peer.token_generation(self.config.settings.max_new_tokens, reps=1, prompt_ids=prompt_ids)
            )
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as err:
            self.peer, self.peer_note = None, f"llama.cpp baseline failed: {err}"
            return None
        return self.peer_runs[-1]

    def run_prompt(
        self, i: int, prompt_ids: list[int], text: str = ""
    ) -> tuple[dict[str, Run], dict[str, Any] | None]:
        """Every method on prompt `i`, in an order that rotates from prompt to prompt (the servers of
        llamacpp-spec get the prompt's text and apply their own chat template)."""
        servers = self.servers.methods if self.servers is not None else []
        rotation = self.all + (["llamacpp"] if self.peer is not None else []) + servers
        order = rotation[i % len(rotation) :] + rotation[: i % len(rotation)]
        runs: dict[str, Run] = {}
        peer_run = None
        for m in order:
            if m == "llamacpp":
                peer_run = self.run_peer(prompt_ids)
            elif m in servers:
                assert self.servers is not None
                self.servers.run(m, text, self.config.settings.max_new_tokens)
            else:
                runs[m] = self.run(m, prompt_ids, self.config.settings.max_new_tokens)
        return runs, peer_run


@dataclass
class Tally:
    """Totals per method and the per-prompt identity flags the summary counts."""

    methods: list[str]
    sizes: list[int]
    totals: dict[str, _Totals] = field(init=False)
    identical: list[bool] = field(default_factory=list)
    plain: list[bool] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)
    size_identical: dict[int, list[bool]] = field(init=False)
    draft_identical: dict[str, list[bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.totals = {m: _Totals() for m in self.methods}
        self.size_identical = {n: [] for n in self.sizes}
