"""The llama.cpp peer baseline (peer.py): llama-bench's JSON read right, the binary found and run.

llama-bench itself is an optional tool that CI does not build (about 10 minutes on 2 cores), so the run test
uses a stand-in executable that prints what llama-bench 0c1e570 printed on this machine (`-o json`), and
checks the arguments it was given; the README's bench table was measured with the real binary.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from medusa_chat.peer import LlamaBench, find_llama_bench, parse_llama_bench_json

REAL_OUTPUT = [
    {
        "build_commit": "0c1e570",
        "cpu_info": "AMD EPYC",
        "model_type": "llama 256M Q4_1",
        "n_threads": 2,
        "n_prompt": 0,
        "n_gen": 16,
        "avg_ns": 246960874,
        "stddev_ns": 0,
        "avg_ts": 64.787591,
        "stddev_ts": 0.0,
    }
]


def test_parse_takes_the_token_generation_record() -> None:
    pp = dict(REAL_OUTPUT[0], n_prompt=64, n_gen=0, avg_ts=351.0)
    r = parse_llama_bench_json(json.dumps([pp, *REAL_OUTPUT]))
    assert r["tokens_per_s"] == pytest.approx(64.787591) and r["n_gen"] == 16 and r["threads"] == 2
    with pytest.raises(RuntimeError, match="no token-generation"):
        parse_llama_bench_json(json.dumps([pp]))
    with pytest.raises(RuntimeError, match="no JSON"):
        parse_llama_bench_json("main: error: failed to load model")


def _stand_in(tmp_path: Path) -> Path:
    script = tmp_path / "llama-bench"
    log = tmp_path / "args.json"
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"json.dump(sys.argv[1:], open({str(log)!r}, 'w'))\n"
        f"print(json.dumps({REAL_OUTPUT!r}))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_runner_passes_model_threads_and_length(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = _stand_in(tmp_path)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("MEDUSA_CHAT_LLAMA_BENCH", str(binary))
    assert find_llama_bench() == binary
    result = LlamaBench(binary, gguf, threads=2).token_generation(128, reps=2)
    assert result["tokens_per_s"] == pytest.approx(64.787591)
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[args.index("-m") + 1] == str(gguf)
    assert args[args.index("-t") + 1] == "2" and args[args.index("-n") + 1] == "128"
    assert args[args.index("-p") + 1] == "0" and args[args.index("-o") + 1] == "json"


def test_missing_binary_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDUSA_CHAT_LLAMA_BENCH", str(tmp_path / "nope"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_bench() is None
