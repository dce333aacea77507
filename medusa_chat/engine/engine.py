"""MedusaEngine: the Medusa decoding loop, top to bottom (prefill -> step -> generate).

    prefill(prompt)                        -> first token (root) + the heads' top-k guesses
    repeat:
        propose   tree tokens = [root, guesses picked by the tree layout]          (gather, on device)
        verify    one backbone forward over all N tree tokens, ancestor-only mask   (the only big compute)
        accept    longest tree path the backbone agrees with (greedy/typical/exact)  (vectorised, on device)
        commit    keep the accepted tokens' KV entries in place, drop the rest      (one index_select)
        bonus     the backbone's own next token after the accepted path = next root (no extra forward)
        guesses   heads on the hidden state of the last accepted node only (same lm_head call as the bonus);
                  Hydra heads instead draft at the next propose, depth by depth from the root (HydraDrafter)
        lookup    where the context's last 2-4 tokens occurred before, what followed them then goes on the
                  tree's main chain instead of the heads' guesses (lookup.py; host side, O(1) per step);
                  after a 4-token match the step verifies a chain of up to LOOKUP_RUN lookup tokens instead;
                  a model without heads drafts with the lookup alone (model/sources/lookup_only.py): its tree is a
                  chain, and each step verifies the root plus the lookup's guesses, or the root alone
        shape     on a CPU with the C drafter, the tree's N nodes are the N - 1 the draft is most confident
                  in (drafters.confident_paths: EAGLE-2's dynamic tree on the Hydra spine), not a fixed layout

One host sync per step (to learn how many tokens were accepted), tree buffers built once per tree, and a
preallocated KV cache whose accepted entries are compacted in place: nothing per step grows with the
conversation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.engine.acceptance import (
    best_path,
    greedy_path,
    greedy_tokens,
    make_acceptor,
    reply_generator,
)
from medusa_chat.engine.drafters import ROOT_ONLY, make_drafter
from medusa_chat.engine.graphs import GraphRecorder, wants_graphs
from medusa_chat.engine.lookup import LOOKUP_RUN, ContextLookup
from medusa_chat.engine.penalties import with_penalties
from medusa_chat.engine.text import (
    StreamDecoder,
    TreeViews,
    keep_until_end,
    limit_reason,
    pushed_text,
    release_held,
    reply_text,
)
from medusa_chat.engine.threads import ThreadGovernor, adapts, threads_line
from medusa_chat.engine.trees import StepTree, TreeBuilder
from medusa_chat.errors import PromptError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
from medusa_chat.model.forward.graph_step import GraphStep
from medusa_chat.model.forward.kv_cache import TreeKVCache
from medusa_chat.model.forward.runner import BackboneRunner
from medusa_chat.model.forward.tree_plan import TreePlan
from medusa_chat.settings import GREEDY, TYPICAL
from medusa_chat.tree import Tree, TreeBuffers

if TYPE_CHECKING:
    from medusa_chat.model.sources.loading import LoadedModel


# Prompt tokens per native-step call (`prefill`): 128-512 measured alike at 2,048 tokens (2.06-2.36 s against
# 3.89 s in one call); 256 also bounds the step's scratch, which grows with the rows.
PREFILL_BLOCK = 256


@dataclass
class StepResult:
    """One verification step after its host sync: what was accepted (host) and what the next step needs."""

    tokens: list[int]  # the tree's tokens, by node
    accepted: list[int]  # the accepted path's nodes, root first (len = accepted candidates + 1)
    bonus: int  # the backbone's own next token after the path: the next root
    bonus_on_device: torch.Tensor  # the same, [1] on the device
    path: torch.Tensor | None  # the accepted path on the device (padded), when the rule computed it there
    draft: torch.Tensor | None  # the next draft: Medusa guesses, or for Hydra the last accepted node's state


class MedusaEngine:
    """Batch-1 Medusa tree decoding on a loaded backbone + heads. One reply at a time.

    Public calls besides `generate`: `prefill` (tokens into the cache), `next_logits_and_guesses`, `step` and
    `trial_step` (one verification step, as the calibration times it), `causal_mask`, `tree_for_room`,
    `step_state`, `lookup_chain`, `confident_tree`, `use_graphs` / `graph`, `shares_cache`, `fresh_cache` and
    `reset`. The drafter (`drafter`, drafters.py) is called only through its interface, whatever its kind.

    The engine holds its parts: `trees` (TreeBuilder, trees.py: which tree, prefix, chain or shape a step verifies,
    and the masks) and `graphs` (GraphRecorder, graphs.py: the step as CUDA graphs on a GPU). The tree and graph
    attributes above are theirs, answered here.
    """

    def __init__(
        self,
        model: LoadedModel,
        tree: Tree | None = None,
        graphs: bool = True,
        shaped: bool = True,
        adaptive: bool = True,
    ) -> None:
        self.model = model
        self.lookup_run = LOOKUP_RUN  # 0: lookup guesses only on the tree's own chain
        self.backbone = model.backbone
        self.runner = BackboneRunner(model.backbone)
        self.lm_head = self.runner.lm_head
        self.heads = model.heads
        self.device = model.device
        self.dtype = model.backbone.get_input_embeddings().weight.dtype  # activations' dtype (NF4 too)
        self.context_limit = model.context_limit
        self.cache = TreeKVCache(model.backbone.config.num_hidden_layers)
        self.cached_ids: list[int] = []  # tokens whose KV entries are in the cache, in order
        self.views = TreeViews(model.tokenizer)  # what the visualiser shows of a step's tree
        # where each step's tree tokens come from (drafters.py, one interface): Medusa heads' guesses, Hydra or
        # block-quantized Medusa heads drafting after the root is known, an EAGLE draft with its own KV cache fed
        # the backbone's features, or context lookup alone; a root-only tree drafts nothing (`set_tree`)
        self._drafter = make_drafter(self.heads, self.backbone, self.runner, getattr(model, "heads_source", ""))
        self.drafter_name = self._drafter.name
        self.trees = TreeBuilder(model, self.runner, self.dtype, self._drafter, ROOT_ONLY, shaped, adaptive)
        graphs = graphs and not self._drafter.reads_features  # (a drafter reading every forward's features)
        # On a GPU the verification step is replayed as a CUDA graph where that is measured faster
        # (graph_step.py; `model.graph_step` from the device's calibration; MEDUSA_CHAT_COMPILE=0: never)
        self.graphs = GraphRecorder(self.runner, self.dtype, self.device, self.context_limit, self.trees.mask,
                                    self._forward)  # fmt: skip
        if graphs and self.device.type == "cuda" and wants_graphs(model, self.runner):
            try:
                self.graphs.record(self.cache, capture=True)
            except torch.cuda.OutOfMemoryError:  # the whole-window cache does not fit: the eager cache grows
                self.cache = TreeKVCache(model.backbone.config.num_hidden_layers)
                self.graphs.note = "CUDA graphs off: no room for their whole-window KV cache"
        self.set_tree(tree or model.default_tree)
        # the native CPU step's thread count: the busy mode while other processes keep the cores busy (threads.py)
        self.threads: ThreadGovernor | None = None
        if self.device.type == "cpu":
            self.threads = ThreadGovernor()
            self.threads.adaptive = self.threads.adaptive and adapts(self.runner)

    def fresh_cache(self, capacity: int = 1024) -> None:
        """Start over on a new, empty KV cache of `capacity` tokens (it grows as needed)."""
        self.cache = TreeKVCache(self.backbone.config.num_hidden_layers, capacity=capacity)
        self.cached_ids.clear()
        self.trees.forget_masks()

    # ---- the engine's parts, asked of the engine -------------------------------------------------------------
    tree = property(lambda self: self.trees.tree, doc="The tree each step verifies (or a prefix of it).")
    buffers = property(lambda self: self.trees.buffers, doc="The tree's device buffers (TreeBuffers).")
    plan = property(lambda self: self.trees.plan, doc="The tree's exact per-node plan (TreePlan), or None.")
    exact = property(lambda self: self.trees.exact, doc="Does the step attend exactly per node (the CPU)?")
    sizer = property(lambda self: self.trees.sizer, doc="The prefix size per step (tree_sizer.py), or None.")
    drafter = property(lambda self: self.trees.drafter, doc="This tree's drafter (ROOT_ONLY for a root-only tree).")
    draft_shaped = property(lambda self: self.trees.draft_shaped, doc=TreeBuilder.draft_shaped.__doc__)
    dynamic_trees = property(lambda self: self.trees.dynamic_trees, doc=TreeBuilder.dynamic_trees.__doc__)
    tree_note = property(lambda self: self.trees.tree_note, doc=TreeBuilder.tree_note.__doc__)
    graph = property(lambda self: self.graphs.graph, doc="The step's CUDA graphs, or None where the eager step runs.")
    graph_note = property(lambda self: self.graphs.note, doc="Why CUDA graphs went off, where they did.")

    def set_tree(self, tree: Tree) -> None:
        self.trees.set_tree(tree)

    def tree_for_room(self, room: int) -> StepTree:
        return self.trees.tree_for_room(room)

    def step_state(self, tree: Tree) -> StepTree:
        return self.trees.step_state(tree)

    def lookup_chain(self, length: int) -> StepTree:
        return self.trees.lookup_chain(length)

    def confident_tree(self, root: torch.Tensor, draft: torch.Tensor | None, size: int) -> StepTree:
        return self.trees.confident_tree(root, draft, size)

    def causal_mask(self, start: int, count: int) -> torch.Tensor:
        return self.trees.causal_mask(start, count)

    def use_graphs(self, capture: bool = True) -> GraphStep:
        """Replay this engine's steps as CUDA graphs (capture=False: run the graphs' code eagerly, as on a CPU)."""
        return self.graphs.record(self.cache, capture)

    # ---- model calls --------------------------------------------------------------------------------------
    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor | TreePlan
    ) -> torch.Tensor:
        hidden = self.runner.forward(ids, positions, attend, self.cache)
        self._drafter.saw(hidden)
        return hidden

    def prefill(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Run `ids` [T] at positions start .. start + T - 1 into the cache (which holds `start` entries): each
        sees the cache and the ones before it. Returns their last hidden states [T, H].

        On the native C step a long prompt goes in blocks of PREFILL_BLOCK tokens: its attention scores a
        block's own keys one at a time and the cached ones 8 at a time (csrc/attention.c), and a token's bits do
        not depend on the blocks (decoder.c), so blocks are the same result, sooner (a 2,048-token prompt on 2
        cores: 3.9 s in one block, 2.1 s in blocks of 256)."""
        if len(ids) > PREFILL_BLOCK and self.runner.native:
            return torch.cat(
                [self.prefill(ids[i : i + PREFILL_BLOCK], start + i) for i in range(0, len(ids), PREFILL_BLOCK)]
            )
        positions = torch.arange(start, start + len(ids), device=self.device)
        hidden = self._forward(ids, positions, self.causal_mask(start, len(ids)))
        self._drafter.record(start, ids)
        return hidden

    def _greedy_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """greedy_tokens(lm_head(hidden)): the block kernel's fused argmax where the lm_head is its Q8_0 linear
        (the same values compared in place, no logits written: qgemm.c, q8_0_gemm_argmax), else the logits."""
        fused = getattr(self.lm_head, "argmax", None)
        top = fused(hidden) if fused is not None else None
        return top if top is not None else greedy_tokens(self.lm_head(hidden))

    def next_logits_and_guesses(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(next-token logits [V], draft) from the last accepted node's hidden state [1, H]: the draft is Medusa
        heads' guesses, the hidden state itself for drafters that draft after the root, or None."""
        return self.drafter.logits_and_draft(self.lm_head, hidden, self.buffers.top_k)

    # ---- one step -----------------------------------------------------------------------------------------
    def step(
        self,
        root: torch.Tensor,
        draft: torch.Tensor | None,
        start: int,
        acceptor: Any,
        produced: int = 0,
        at: StepTree | None = None,
    ) -> StepResult:
        """One decoding step: propose -> verify -> accept -> bonus, then the step's one host sync.

        Returns what was accepted (host lists) and what the next step starts from (device tensors); the caller
        commits (`cache.keep`). `generate` and the calibration that times steps both run this, so what is
        timed is what a reply pays. `at`: the tree this step verifies (TreeBuilder.for_step: a prefix of the tree
        near the end of the context window, a lookup chain, a draft-shaped tree), with the context lookup's
        guesses for its main chain (lookup.py; they replace the drafter's tokens there) and its tokens where they
        are drafted already; by default the whole tree, drafted here.
        """
        at = at if at is not None else self.tree_for_room(self.tree.size)
        buf, plan = at.buf, at.plan
        # one lm_head call for every node: small trees whose next draft needs no lm_head (Hydra, no heads, none)
        logits_once = buf.tree.size <= 16 and (not self.drafter.needs_logits or buf.tree.size == 1)
        # propose: node 0 is the root; node i is the guess of head depth-1 at the node's rank
        tokens = at.tokens if at.tokens is not None else self._propose(root, draft, buf, at.guess)
        # verify: one forward over the N tree tokens (on a GPU a replayed CUDA graph of it: graph_step.py)
        step_logits = None
        if self.graphs.graph is not None:
            hidden, step_logits = self.graphs.step(tokens, start, buf, self.cache)
        if step_logits is None:
            attend = plan if plan is not None else self.trees.mask(start, buf)
            hidden = self._forward(tokens, start + buf.depth, attend)
        # accept: nodes with children need full-vocab logits to judge their children, the last accepted node
        # one more row for the bonus. Small trees without v2 heads get every row in one lm_head call (on a CPU
        # the lm_head is the biggest single read of a step, and a few more rows cost little); big trees only
        # the rows they need (about a third of a published tree), the bonus row after acceptance.
        logits = None
        penalise = getattr(acceptor, "penalise_step", None)
        if logits_once and penalise is not None and acceptor.greedy_from_argmax:
            # Greedy under penalties that only lower logits (the default DRY): a node's penalised argmax is its
            # raw argmax unless that token is penalised at the node, so the fused argmax serves every row and only
            # such rows get their logits computed and penalised (penalties.py, greedy_tops).
            top = self._greedy_rows(hidden) if step_logits is None else greedy_tokens(step_logits)
            n = buf.tree.size
            host = torch.cat([tokens, top]).tolist()  # the step's one host sync
            tree_tokens = host[:n]
            rows = lambda nodes: (self.lm_head(hidden[nodes]) if step_logits is None else step_logits[nodes]).float()  # noqa: E731
            tops = acceptor.greedy_tops(tree_tokens, buf, host[n:], rows, hidden.device)
            accepted = greedy_path(tree_tokens, tops, buf.tree.children)
            last = accepted[-1]
            bonus = torch.tensor([tops[last]], dtype=top.dtype, device=top.device)
            return StepResult(tree_tokens, accepted, tops[last], bonus, None, self.drafter.draft_from(hidden[last : last + 1]))
        if logits_once and penalise is not None:
            # Repetition penalties (penalties.py): every row once, in place, with its own node's context; the
            # inner rule then runs on them as on raw logits (greedy: the argmax walk below).
            logits = self.lm_head(hidden).float() if step_logits is None else step_logits.float().clone()
            acceptor = penalise(logits, tokens, buf)
        if logits_once and acceptor.accept_mode == GREEDY and acceptor.argmax_only:
            # Greedy needs only each node's argmax: one pass over all the rows' logits, no copies of logit rows.
            # A node is accepted iff its token is its parent's argmax; the bonus is the last accepted node's.
            # The sync brings the tree's tokens and argmaxes (2N ints) to the host, where walking a tree of <= 16
            # nodes costs microseconds: a dozen tiny device ops for the same walk cost ~0.3 ms a step on a CPU.
            if logits is not None:
                top = greedy_tokens(logits)
            else:
                top = self._greedy_rows(hidden) if step_logits is None else greedy_tokens(step_logits)
            n = buf.tree.size
            host = torch.cat([tokens, top]).tolist()  # the step's one host sync
            tree_tokens, tops = host[:n], host[n:]
            accepted = greedy_path(tree_tokens, tops, buf.tree.children)
            last = accepted[-1]
            draft = self.drafter.draft_from(hidden[last : last + 1])
            return StepResult(tree_tokens, accepted, tops[last], top[last : last + 1], None, draft)
        if logits_once or step_logits is not None:
            if logits is None:
                logits = (self.lm_head(hidden) if step_logits is None else step_logits).float()
            parent_logits = logits.index_select(0, buf.internal)
        else:
            parent_logits = self.lm_head(hidden[buf.internal]).float()
        # judge every node against its parent by the reply's rule, then the path / bonus code all share
        ok, logp = acceptor.judge(parent_logits, tokens, buf, produced)
        path, count = best_path(ok, buf.leaf_paths, logp)
        last = path.gather(0, count.view(1))
        if logits_once or (step_logits is not None and not self.drafter.needs_logits):
            last_logits = logits.index_select(0, last)[0]
            draft = self.drafter.draft_from(hidden.index_select(0, last))
        else:
            last_logits, draft = self.next_logits_and_guesses(hidden.index_select(0, last))
        bonus = acceptor.bonus(last_logits, last, count)
        n, width = buf.tree.size, path.shape[0]
        host = torch.cat([tokens, path, count[None].to(tokens.dtype), bonus]).tolist()  # the one host sync
        accepted = host[n : n + host[n + width] + 1]
        return StepResult(host[:n], accepted, host[-1], bonus, path, draft)

    def _propose(
        self, root: torch.Tensor, draft: torch.Tensor | None, buf: TreeBuffers, lookup_guess: list[int]
    ) -> torch.Tensor:
        """The tree's tokens [N]: the drafter's guesses, with the lookup's on the main chain where it has some."""
        chain = buf.chain[: len(lookup_guess)] if lookup_guess else []
        if not chain:
            return self.drafter.propose(root, draft, buf)
        guess = torch.tensor(lookup_guess[: len(chain)], dtype=root.dtype, device=root.device)
        if len(chain) == buf.tree.size - 1:  # the tree is that chain: the lookup fills it, nothing to draft
            return torch.cat([root, guess])
        tokens = self.drafter.propose(root, draft, buf)
        return tokens.index_copy_(0, buf.chain_index[: len(chain)], guess)

    def trial_step(self, root: torch.Tensor, draft: torch.Tensor | None, acceptor: Any) -> StepResult:
        """One step at the cache's end with its host sync and commit, then the cache put back as it was: what
        the calibration times (every repetition sees the same context)."""
        start = self.cache.length
        # (a draft-shaped tree: the tree a reply's step drafts and verifies)
        at = self.confident_tree(root, draft, self.tree.size) if self.draft_shaped and draft is not None else None
        done = self.step(root, draft, start, acceptor, 0, at)
        self.cache.keep(start, done.accepted, done.path)
        self.cache.crop(start)
        return done

    # ---- one reply ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        settings: GenerationSettings | None = None,
        stop: threading.Event | None = None,
    ) -> Iterator[StepEvent | ReplySummary]:
        """One reply: prefill, then one tree step after another until EOS, a stop string, the token limit, the
        context window or `stop`. Yields a StepEvent per step (the prefill's first token is step 0), then the
        ReplySummary."""
        settings = settings or GenerationSettings()
        if self.threads is not None:
            self.threads.resume()
        acceptor = self._reply_acceptor(prompt_ids, settings)
        eos = set(self.model.eos_token_ids)
        stop_strings = tuple(s for s in (*settings.stop_strings, *self.model.stop_strings) if s)
        # The reply ends at max_new_tokens or where prompt + reply fill the context window, whichever is first.
        limit = min(settings.max_new_tokens, self.context_limit - len(prompt_ids))
        t0 = time.perf_counter()

        # ---- prefill: reuse the cached prefix of the previous reply when the prompt extends it ----
        reused, hidden = self._prefill_prompt(prompt_ids)
        root_logits, guesses = self.next_logits_and_guesses(hidden)
        root = acceptor.first(root_logits)
        first = int(root.item())
        prefill_s = time.perf_counter() - t0

        reply, stop_reason = keep_until_end([first], 0, eos, limit)
        acceptor.commit(reply)
        stop_reason = limit_reason(stop_reason, len(reply), settings.max_new_tokens)
        detok = StreamDecoder(self.model.tokenizer)
        # Streamed text that could be the start of a stop string is held back until a later step settles it.
        text, held, hit = release_held(pushed_text(detok, reply, stop_reason), stop_strings, final=bool(stop_reason))
        stop_reason = "stop_string" if hit else stop_reason
        yield StepEvent(0, list(reply), text, [], None, prefill_s, 1, prefill_s, 0.0, 0.0)
        steps, accepted_lengths, busy_steps = 0, [], 0
        sized_steps: dict[int, int] = {}
        # the context's n-gram index for lookup guesses (prompt + reply so far; the root is the last token).
        # Not under typical acceptance: that rule keeps any plausible guess, so lookup guesses would make
        # sampled replies repeat earlier text more often than the model does (greedy and exact: no such effect).
        use_lookup = settings.context_lookup and self.tree.size > 1 and settings.accept_mode != TYPICAL
        lookup = ContextLookup([*prompt_ids, first]) if use_lookup else None
        # runs of lookup guesses longer than the tree's chain: where a step's tree is free (the exact CPU step)
        runs = self.lookup_run if self.exact and self.graphs.graph is None else 0
        decode_t0 = time.perf_counter()

        # ---- decode: one tree verification per step ----
        while not stop_reason:
            if stop is not None and stop.is_set():
                stop_reason = "stopped"
                break
            start = self.cache.length
            step_t0 = time.perf_counter()
            one_thread = self.threads is not None and self.threads.threads in (1, self.threads.busy)
            at = self.trees.for_step(root, guesses, self.context_limit - start, lookup, runs, one_thread)
            done = self.step(root, guesses, start, acceptor, len(reply), at)
            new_tokens = self._commit(start, done)
            root, guesses = done.bonus_on_device, done.draft
            steps += 1
            accepted_lengths.append(len(done.accepted) - 1)
            # EOS and the length limit can only be in the new tokens: O(new tokens) per step, not O(reply).
            new_tokens, stop_reason = keep_until_end(new_tokens, len(reply), eos, limit)
            reply.extend(new_tokens)
            acceptor.commit(new_tokens)
            if lookup is not None:
                lookup.extend(new_tokens)
            stop_reason = limit_reason(stop_reason, len(reply), settings.max_new_tokens)
            pushed = pushed_text(detok, new_tokens, stop_reason)
            delta, held, hit = release_held(held + pushed, stop_strings, final=bool(stop_reason))
            stop_reason = "stop_string" if hit else stop_reason
            now = time.perf_counter()
            if self.threads is not None:
                busy_steps += self.threads.threads != self.threads.full  # (the step that was just timed)
                self.threads.observe(now - step_t0, at.tree.size)
            sized = self.trees.sized
            if sized is not None and self.sizer is not None:
                self.sizer.observe(sized, now - step_t0)
                sized_steps[sized] = sized_steps.get(sized, 0) + 1
            decode_s = now - decode_t0
            yield StepEvent(
                step=steps,
                token_ids=new_tokens,
                text=delta,
                accepted_nodes=done.accepted,
                tree=self.views.view(at.tree, at.buf.chain[: len(at.guess)], done.tokens),
                step_time_s=now - step_t0,
                new_tokens_total=len(reply),
                elapsed_s=now - t0,
                decode_tokens_per_s=(len(reply) - 1) / decode_s if decode_s > 0 else 0.0,
                tokens_per_step=(len(reply) - 1) / steps,
            )

        decode_s = time.perf_counter() - decode_t0
        decode_tokens = len(reply) - 1
        message = ""
        if stop_reason == "context_limit":
            message = f"stopped at the model's context window ({self.context_limit} tokens)"
        yield ReplySummary(
            text=reply_text(detok.text, stop_strings, held),
            token_ids=reply,
            new_tokens=len(reply),
            steps=steps,
            tokens_per_step=decode_tokens / steps if steps else 0.0,
            decode_tokens_per_s=decode_tokens / decode_s if steps and decode_s > 0 else 0.0,
            time_to_first_token_s=prefill_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            prompt_tokens=len(prompt_ids),
            reused_prefix_tokens=reused,
            accept_mode=settings.accept_mode,
            stop_reason=stop_reason,
            tree_size=self.tree.size,
            message=message,
            accepted_lengths=accepted_lengths,
            threads=threads_line(self.threads if self.device.type == "cpu" else None, steps, busy_steps),
            sized_steps=dict(sorted(sized_steps.items())),
        )

    # ---- the reply's steps, by name ----------------------------------------------------------------------
    def _reply_acceptor(self, prompt_ids: list[int], settings: GenerationSettings) -> Any:
        """Check the request, then the reply's acceptance rule (greedy / typical / exact, acceptance.py) with
        its random generator (exact draws the reply's uniforms here)."""
        settings.validate()
        if not prompt_ids:
            raise PromptError("the prompt is empty: type a message first")
        if len(prompt_ids) + 1 >= self.context_limit:
            raise PromptError(
                f"the prompt is {len(prompt_ids)} tokens but the model's context window is {self.context_limit}: "
                "shorten it or start a new conversation"
            )
        generator = reply_generator(settings, self.device)
        acceptor = make_acceptor(settings, generator, self.device, settings.max_new_tokens + self.tree.depth + 1)
        # repetition controls: each node's logits penalised with its own context (penalties.py); off, as is
        return with_penalties(acceptor, settings, prompt_ids, self.model.tokenizer)

    def _prefill_prompt(self, prompt_ids: list[int]) -> tuple[int, torch.Tensor]:
        """Prefill the prompt past the prefix the cache already holds (at least its last token): (tokens
        reused, the last prompt token's hidden state [1, H])."""
        reused = 0
        for a, b in zip(self.cached_ids, prompt_ids[:-1], strict=False):  # keep >= 1 token to prefill
            if a != b:
                break
            reused += 1
        self.cache.crop(reused)
        del self.cached_ids[reused:]
        new = torch.tensor(prompt_ids[reused:], dtype=torch.long, device=self.device)
        hidden = self.prefill(new, reused)[-1:]
        self.cached_ids.extend(prompt_ids[reused:])
        return reused, hidden

    def _commit(self, start: int, done: StepResult) -> list[int]:
        """Root + accepted candidates enter the cache (the rest of the tree's entries are dropped); returns the
        step's new reply tokens (the accepted candidates, then the bonus, the next root)."""
        self.cache.keep(start, done.accepted, done.path)
        self.cached_ids.extend(done.tokens[n] for n in done.accepted)
        self._drafter.commit(start, done.accepted, done.tokens)  # (an EAGLE draft keeps their features)
        return [done.tokens[n] for n in done.accepted[1:]] + [done.bonus]

    # ---- what calibration asks ---------------------------------------------------------------------------
    @property
    def shares_cache(self) -> bool:
        """Can another engine on the same model start from a copy of this one's cache (`cache`, `cached_ids`)? On
        a CPU, where the cache is the engine's own and the drafter keeps no state of its own (an EAGLE draft's
        KV cache); a GPU engine's cache may be its CUDA graphs' buffers."""
        return self.device.type == "cpu" and self.graphs.graph is None and not self._drafter.reads_features

    def reset(self) -> None:
        """Forget the cached prefix (e.g. after a model-level change)."""
        self.cache.crop(0)
        self.cached_ids.clear()


def plain_tree() -> Tree:
    """Root-only tree: the engine's own plain (one token per step) loop, used as a baseline."""
    return Tree.chain(0)
