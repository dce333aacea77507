"""A model without Medusa heads is still a chat: context lookup is its only drafter (model/sources/lookup_only.py).

A saved tiny backbone folder without heads loads; its greedy replies are bitwise the plain loop's while lookup
guesses are verified and accepted; exact sampling keeps the plain loop's law; trees, calibration, `info`, the
REPL banner and the web model panel all say "context lookup only" and name `medusa-chat train-heads`; heads
that are given but missing or broken still fail loudly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.errors import HeadsError, ModelNotFoundError, TreeError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
from medusa_chat.model.sources.loaded import LoadedModel, summary_lines
from medusa_chat.model.sources.loading import load_model
from medusa_chat.model.sources.lookup_only import LOOKUP_ONLY
from medusa_chat.tree import Tree
from medusa_chat.tuning.calibrate import lookup_only_latency
from medusa_chat.tuning.tree_choice import choose_tree, heads_stamp

LINE = "no Medusa heads: context lookup only"
_LOADED: dict[str, LoadedModel] = {}


def no_heads(folder: Path, quant: str = "fast") -> LoadedModel:
    """The tiny planted backbone folder (no heads, no medusa_head.* keys) as load_model gives it; once per quant.
    "fast": int8 on the block kernel (the native C step a CPU runs, ~10x the fp32 step here) where it runs."""
    from medusa_chat.kernels import cbind

    if quant == "fast":
        quant = "int8" if cbind.available() else "none"
    if quant not in _LOADED:
        if quant != "none" and not cbind.available():
            pytest.skip(f"block kernel: {cbind.unavailable_reason()}")
        _LOADED[quant] = load_model(model=str(folder), device="cpu", quant=quant)
    return _LOADED[quant]


def reply(engine: MedusaEngine, prompt: list[int], **kw) -> tuple[list[StepEvent], ReplySummary]:
    items = list(engine.generate(prompt, GenerationSettings(**{"max_new_tokens": 64, **kw})))
    return [e for e in items[:-1] if e.tree is not None], items[-1]


def repetitive_prompts(plain: MedusaEngine, starts: tuple[int, ...] = (40, 7, 100)) -> list[list[int]]:
    """Prompts that walked part of the planted successor map once and start it again, so what comes next is in
    the context (the lookup knows it), plus a prompt that repeats a few tokens and one that repeats nothing."""
    prompts = []
    for start in starts:
        walk = reply(plain, [start], max_new_tokens=24)[1].token_ids
        prompts.append([start, *walk, start, walk[0]])
    return [*prompts, [5, 9, 17, 33, 5, 9, 17, 33, 5, 9], [11, 12, 13, 14]]


# ---- loading ---------------------------------------------------------------------------------------------------
def test_a_folder_without_heads_loads_lookup_only(tiny_llama_dir: Path) -> None:
    loaded = no_heads(tiny_llama_dir, "none")
    assert loaded.heads is None and loaded.heads_source == LOOKUP_ONLY == "none (context lookup only)"
    assert loaded.spec.kind == "no-heads" and loaded.heads_file == ""
    assert loaded.default_tree.paths == Tree.chain(3).paths  # a chain for the lookup's guesses
    info = loaded.info()
    json.dumps(info)  # plain data, for the UIs
    assert info["heads"]["count"] == 0 and info["heads"]["source"] == LOOKUP_ONLY
    assert info["memory"]["heads_bytes"] == 0
    assert info["memory"]["total_bytes"] == info["memory"]["backbone_bytes"]
    text = "\n".join(summary_lines(info))
    assert LINE in text and f"`medusa-chat train-heads --model {tiny_llama_dir}`" in text
    assert heads_stamp(loaded) == LOOKUP_ONLY  # its calibration is never taken for one made with heads


def test_heads_that_are_given_must_still_be_there_and_sound(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Only the absence of heads is allowed: --heads naming nothing, an empty folder or a broken file fails."""
    with pytest.raises(ModelNotFoundError, match="heads folder .* does not exist"):
        load_model(model=str(tiny_llama_dir), heads=str(tmp_path / "missing"), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadsError, match=r"no Medusa heads in .*empty"):
        load_model(model=str(tiny_llama_dir), heads=str(tmp_path / "empty"), device="cpu")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "medusa_lm_head.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file
    (broken / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(HeadsError):
        load_model(model=str(tiny_llama_dir), heads=str(broken), device="cpu")


def test_trees_without_heads_are_chains(tiny_llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))  # no calibration: the default tree
    loaded = no_heads(tiny_llama_dir)
    assert choose_tree(loaded) == (loaded.default_tree, "default")
    assert choose_tree(loaded, "chain-6")[0].depth == 6  # any depth: the lookup's runs are not heads
    assert choose_tree(loaded, tree_size=2)[0].size == 2
    with pytest.raises(TreeError, match="no Medusa heads: context lookup drafts one chain"):
        choose_tree(loaded, "mc_sim_7b_63")
    with pytest.raises(TreeError, match="chain-N"):
        MedusaEngine(loaded, Tree.from_paths([[0], [1]]))


# ---- decoding --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_greedy_is_the_plain_loop_and_lookup_guesses_are_accepted(tiny_llama_dir: Path, quant: str) -> None:
    """int8: the native C step on the block kernel; none: fp32 (the lean forward), fewer cases (slower here)."""
    loaded = no_heads(tiny_llama_dir, quant)
    plain = MedusaEngine(loaded, plain_tree())
    accepted, best = 0, 0.0
    trees = (loaded.default_tree, Tree.chain(1), Tree.chain(6)) if quant != "none" else (loaded.default_tree,)
    prompts = repetitive_prompts(plain, (40, 7, 100, 233) if quant != "none" else (40, 7))
    for tree in trees:
        engine = MedusaEngine(loaded, tree)
        for prompt in prompts:
            ref = reply(plain, prompt)[1]
            events, got = reply(engine, prompt)
            assert got.token_ids == ref.token_ids, (tree.name, prompt[:4])  # bitwise the plain loop's reply
            # each step verified the root plus the lookup's guesses only: no node nobody drafted
            assert all(len(e.tree.tokens) == 1 + len(e.tree.lookup_nodes) for e in events)
            accepted += sum(len(e.accepted_nodes) - 1 for e in events)
            best = max(best, got.tokens_per_step)
            assert got.steps <= ref.steps
    assert accepted > 10 and best > 1.2, (accepted, best)  # the lookup really drafted, and was right


@pytest.mark.parametrize("path", ["transformers", "graphs"])
def test_the_masked_and_graph_steps_without_heads(tiny_llama_dir: Path, path: str, monkeypatch) -> None:
    """What a GPU runs, here on the CPU: the transformers forward with the additive tree mask (no exact per-node
    attention), and the CUDA-graph step's code run eagerly (float64, as tests/test_graph_step.py does). Each step
    verifies a prefix of the chain as long as the lookup's guess, built once per size."""
    from transformers import AutoModelForCausalLM

    if path == "transformers":
        monkeypatch.setenv("MEDUSA_CHAT_LEAN", "0")
    dtype = torch.float64 if path == "graphs" else torch.float32
    backbone = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype).eval().requires_grad_(False)
    loaded = dataclasses.replace(no_heads(tiny_llama_dir, "none"), backbone=backbone)  # unpacked float weights
    plain, engine = MedusaEngine(loaded, plain_tree()), MedusaEngine(loaded, loaded.default_tree)
    assert (engine.runner.lean is None) == (path == "transformers")
    if path == "graphs":
        engine.use_graphs(capture=False)
    accepted = 0
    for prompt in repetitive_prompts(plain, (40, 7))[:2]:  # the two walks (slower forwards: fewer replies)
        events, got = reply(engine, prompt, max_new_tokens=40)
        assert got.token_ids == reply(plain, prompt, max_new_tokens=40)[1].token_ids, prompt[:4]
        assert all(len(e.tree.tokens) == 1 + len(e.tree.lookup_nodes) for e in events)
        accepted += sum(len(e.accepted_nodes) - 1 for e in events)
    assert accepted > 4, accepted
    if path == "graphs":
        assert engine.graph is not None, engine.graph_note  # the graphs' code ran and agreed with the eager step


def test_lookup_off_or_typical_is_the_plain_loop(tiny_llama_dir: Path) -> None:
    loaded = no_heads(tiny_llama_dir)
    plain, engine = MedusaEngine(loaded, plain_tree()), MedusaEngine(loaded, loaded.default_tree)
    prompt = repetitive_prompts(plain)[0]
    events, got = reply(engine, prompt, context_lookup=False)
    assert got.token_ids == reply(plain, prompt)[1].token_ids and got.steps == got.new_tokens - 1
    events, got = reply(engine, prompt, temperature=0.8, seed=1, accept="typical")
    assert all(len(e.tree.tokens) == 1 for e in events)  # typical acceptance never takes lookup guesses
    assert got.token_ids == reply(plain, prompt, temperature=0.8, seed=1, accept="typical")[1].token_ids


def test_exact_sampling_runs_and_keeps_the_plain_loops_draws(tiny_llama_dir: Path) -> None:
    """At temperature > 0 the exact rule's reply does not depend on drafts that depend only on emitted tokens:
    same seed, same reply as the plain loop, with lookup guesses accepted along the way."""
    loaded = no_heads(tiny_llama_dir)
    plain, engine = MedusaEngine(loaded, plain_tree()), MedusaEngine(loaded, loaded.default_tree)
    accepted = 0
    for prompt in repetitive_prompts(plain)[:4]:
        for seed in range(3):
            kw = dict(temperature=0.5, top_p=0.95, seed=seed, accept="exact", max_new_tokens=40)
            events, got = reply(engine, prompt, **kw)
            assert got.token_ids == reply(plain, prompt, **kw)[1].token_ids, seed
            accepted += sum(len(e.accepted_nodes) - 1 for e in events)
    assert accepted > 4, accepted


# ---- calibration -----------------------------------------------------------------------------------------------
def test_lookup_only_latency_charges_only_the_nodes_a_step_verifies() -> None:
    step = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6}
    # 3 plain steps, one with 1 guess, one with 3: a 4-node chain costs 1.6 only on the last step
    got = lookup_only_latency(step, [1, 1, 1, 2, 4])
    assert got[1] == pytest.approx(1.0)
    assert got[2] == pytest.approx((3 * 1.0 + 1.2 + 1.2) / 5)
    assert got[4] == pytest.approx((3 * 1.0 + 1.2 + 1.6) / 5)


def test_calibration_picks_a_lookup_chain_and_chat_uses_it(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from medusa_chat.tuning.first_start import resolve_tree
    from medusa_chat.tuning.tree_choice import load_calibration, model_identity

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    loaded = no_heads(tiny_llama_dir)
    tree, source = resolve_tree(loaded, progress=lambda m: None, auto_calibrate=True)  # calibrates and caches
    record = load_calibration(*model_identity(loaded))
    assert record is not None and record["lookup_only"] and record["heads_stamp"] == LOOKUP_ONLY and record["tree"] == "chain-3"
    assert [s["size"] for s in record["sizes"]] == [1, 2, 3, 4]  # every chain length a step may verify
    # the built-in prompts' replies repeat little here: no evidence against the lookup, so it stays on
    assert record["tree_size"] >= 2
    assert tree.size == record["tree_size"] and not any(any(p) for p in tree.paths) and source.startswith("calibrated")
    assert choose_tree(loaded) == (tree, source)  # the next start reads it back


# ---- what the user sees ----------------------------------------------------------------------------------------
def test_info_says_lookup_only_and_names_train_heads(tiny_llama_dir: Path, capsys, monkeypatch) -> None:
    from medusa_chat.cli import main

    assert main(["info", "--model", str(tiny_llama_dir), "--quant", "none", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"heads      {LINE} (train heads with `medusa-chat train-heads --model {tiny_llama_dir}`" in out
    assert "drafts     context lookup only (no Medusa heads)" in out
    assert re.search(r"tree used  chain-3 \(4 nodes, depth 3", out)
    assert main(["info", "--model", str(tiny_llama_dir), "--quant", "none", "--device", "cpu", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["heads"]["source"] == LOOKUP_ONLY and "medusa-chat train-heads --model" in info["heads"]["note"]
    # the command named is one the CLI takes, for this model (and a path with a space stays one argument)
    from medusa_chat.cli import build_parser
    from medusa_chat.model.sources.lookup_only import train_heads_command

    for model in (str(tiny_llama_dir), "/models/my model", "org/name"):
        argv = shlex.split(train_heads_command(model))
        assert argv[:2] == ["medusa-chat", "train-heads"]
        args = build_parser("train-heads").parse_args(argv[1:])
        assert args.command == "train-heads" and args.model == model


@pytest.mark.slow
def test_web_model_panel_says_lookup_only(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from medusa_chat.chat.session import SessionManager, SessionOptions
    from medusa_chat.ui import web

    session = SessionManager(SessionOptions(model=str(tiny_llama_dir), quant="none", device="cpu"), tmp_path)
    ui = web.WebApp(session)
    session.update_settings(max_new_tokens=8)
    outputs = list(ui.send("hello hello hello", False))  # loads the model (real load_model), then replies
    assert ui.loader.status == "ready" and outputs[-1][0][-1]["role"] == "assistant"
    panel = ui.model_panel()
    assert "Model ready" in panel and LINE in panel
    assert f"medusa-chat train-heads --model {tiny_llama_dir}" in panel


@pytest.mark.slow
def test_terminal_banner_says_lookup_only(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The real `medusa-chat` REPL in a pseudo-terminal (tests/test_terminal.py's way): the startup panel says
    lookup only and names train-heads, and a reply streams."""
    pexpect = pytest.importorskip("pexpect")
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, MEDUSA_CHAT_DATA=str(tmp_path), HF_HUB_OFFLINE="1", TERM="xterm-256color",
               COLUMNS="160", LINES="40", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))  # fmt: skip
    args = ["-m", "medusa_chat", "--model", str(tiny_llama_dir), "--quant", "none", "--max-new-tokens", "6"]
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=90, dimensions=(40, 160))
    try:
        child.expect("you>")
        banner = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", child.before)  # colours off
        flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", banner).split())  # the panel's rows as one line
        assert LINE in flat, banner
        assert f"medusa-chat train-heads --model {tiny_llama_dir}" in flat, banner
        child.sendline("hello hello hello")
        child.expect("tokens/step")
        child.expect("you>")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
