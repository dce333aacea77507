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

from medusa_chat.bench.peer import LlamaBench, find_llama_bench, parse_llama_bench_json

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


def test_without_a_binary_an_installed_llama_cpp_python_is_the_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from medusa_chat.bench import peer
    from medusa_chat.model.sources.registry import DEFAULT_MODEL, MODELS

    monkeypatch.setenv("MEDUSA_CHAT_LLAMA_BENCH", str(tmp_path / "nope"))
    monkeypatch.setenv("PATH", str(tmp_path))
    loaded = type("Loaded", (), {"spec": MODELS[DEFAULT_MODEL]})()  # the embedded model's real spec
    monkeypatch.setattr(peer, "llama_cpp_installed", lambda: False)
    runner, note = peer.llama_bench_for(loaded, 2)
    assert runner is None and "llama-cpp-python" in note and "llama-bench" in note
    monkeypatch.setattr(peer, "llama_cpp_installed", lambda: True)
    runner, note = peer.llama_bench_for(loaded, 2)
    assert isinstance(runner, peer.LlamaCppPython) and note == "" and runner.threads == 2
    assert runner.gguf == peer.model_gguf(loaded)
    # a model that did not come from a GGUF has no peer, whatever is installed
    runner, note = peer.llama_bench_for(type("Loaded", (), {"spec": None})(), 2)
    assert runner is None and "GGUF" in note


@pytest.mark.skipif(
    not __import__("medusa_chat.bench.peer").bench.peer.llama_cpp_installed(), reason="llama-cpp-python absent"
)
def test_llama_cpp_python_decodes_the_same_prompt_greedily() -> None:
    """Runs only where llama-cpp-python is installed (CI does not build it): the real library on the real
    GGUF, the bench's own prompt, greedy."""
    from medusa_chat.bench.peer import LlamaCppPython
    from medusa_chat.model.sources.embedded import gguf_path

    runner = LlamaCppPython(gguf_path(), threads=2, context=256)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30]
    result = runner.token_generation(24, reps=2, prompt_ids=prompt)
    assert result["tokens_per_s"] > 0 and result["prompt_tokens"] == len(prompt) and result["n_gen"] == 24
    assert result["build"].startswith("llama-cpp-python")
    with pytest.raises(RuntimeError, match="context"):
        runner.token_generation(300, prompt_ids=prompt)
