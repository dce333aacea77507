"""benchmarks/draft_vocab.py on files built here: `widen` keeps the heads' draft vocabulary in order and appends
the data's most frequent missing tokens, then unseen ids, and the widened folder loads as Hydra heads and drafts;
`coverage` counts a bench's reply tokens inside each vocabulary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from medusa_chat.model.forward.heads import HydraHeads
from medusa_chat.model.sources.heads_files import load_heads_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "draft_vocab.py"
VOCAB, HIDDEN = 40, 32


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], check=True, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    return done.stdout


def _heads_folder(folder: Path, draft_vocab: list[int]) -> None:
    torch.manual_seed(0)
    heads = HydraHeads(HIDDEN, VOCAB, num_heads=2, num_layers=1, draft_vocab=torch.tensor(draft_vocab))
    state = {k: v.contiguous() for k, v in heads.state_dict().items()}
    state["draft_vocab"] = state["draft_vocab"].to(torch.int32)
    folder.mkdir()
    save_file(state, str(folder / "medusa_lm_head.safetensors"))
    (folder / "config.json").write_text(json.dumps(heads.config_dict("tiny")))
    (folder / "tree.json").write_text(json.dumps({"name": "t", "paths": [[0], [1], [0, 0]]}))


def _data(path: Path, replies: list[list[int]]) -> None:
    """An exported distillation file: a 2-token prompt before each reply."""
    ids, offsets, starts = [], [0], []
    for reply in replies:
        ids += [1, 2, *reply]
        offsets.append(len(ids))
        starts.append(2)
    np.savez(path, ids=np.array(ids), offsets=np.array(offsets), reply_start=np.array(starts))


def test_widen_appends_the_datas_most_frequent_missing_tokens_and_the_heads_still_load(tmp_path: Path) -> None:
    _heads_folder(tmp_path / "heads", [5, 3, 9])
    _data(tmp_path / "d.npz", [[7, 7, 7, 3, 11], [11, 7, 5, 2]])  # 7 x4, 11 x2, 2 x1 (prompt tokens not counted)
    _run("widen", "--heads", str(tmp_path / "heads"), "--size", "8", "--data", str(tmp_path / "d.npz"),
         "--out", str(tmp_path / "wide"))  # fmt: skip
    vocab = load_file(str(tmp_path / "wide" / "medusa_lm_head.safetensors"))["draft_vocab"].tolist()
    assert vocab == [5, 3, 9, 7, 11, 2, 0, 1]  # kept, then by frequency, then unseen ids in order
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["draft_vocab_size"] == 8
    heads = load_heads_file(tmp_path / "wide")[0]
    assert isinstance(heads, HydraHeads) and heads.draft_vocab.tolist() == vocab
    index = heads.vocab_index(VOCAB)
    assert index[11].item() == 4 and index[39].item() == -2  # guessable now / still outside


def test_coverage_counts_the_replies_tokens_inside_each_vocabulary(tmp_path: Path) -> None:
    _heads_folder(tmp_path / "heads", [5, 3, 9, 7])
    _data(tmp_path / "d.npz", [[7, 7, 11, 11, 11]])
    bench = tmp_path / "bench.json"
    # the first token of each reply is the prefill's and is left out: 5 | 7 3 11 20 and 9 | 5 5 12
    bench.write_text(json.dumps({"prompts": [{"baseline_token_ids": [5, 7, 3, 11, 20]},
                                             {"baseline_token_ids": [9, 5, 5, 12]}]}))  # fmt: skip
    out = _run("coverage", "--bench-json", str(bench), "--draft", str(tmp_path / "heads"),
               "--data", str(tmp_path / "d.npz"), "--sizes", "1,2", "--json", str(tmp_path / "c.json"))  # fmt: skip
    assert "7 reply tokens" in out
    assert f"(4 tokens): {4 / 7:.4f}" in out  # 7 3 5 5
    assert f"the 1 most frequent tokens of --data: {1 / 7:.4f}" in out  # 11
    assert f"the 2 most frequent tokens of --data: {2 / 7:.4f}" in out  # 11, 7
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["reply_tokens"] == 7 and doc["most_frequent"] == {"1": round(1 / 7, 4), "2": round(2 / 7, 4)}
