"""`bench --baselines llamacpp-spec`: the streamed-reply parsing and timing, the server processes, and the
summary; against a stand-in server process where llama.cpp is not built, and against the real `llama-server`
where it is (those tests skip without one)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from medusa_chat.bench import server_peers
from medusa_chat.bench.api_client import Reply, acceptance, reply_from_events, sse_payload, stream_chat
from medusa_chat.bench.server_peers import (
    REFERENCE,
    SERVE,
    ServerPeers,
    ServerTally,
    find_llama_server,
    llama_server_argv,
    request_options,
    start_server_peers,
)
from medusa_chat.errors import MedusaChatError

STUB = Path(__file__).with_name("stub_llama_server.py")


def test_sse_lines_parse_and_done_ends_nothing() -> None:
    assert sse_payload(b'data: {"choices": []}\n') == {"choices": []}
    assert sse_payload(b"data: [DONE]\n") is None
    assert sse_payload(b": keep-alive\n") is None and sse_payload(b"\n") is None
    with pytest.raises(MedusaChatError, match="not JSON"):
        sse_payload(b"data: {oops\n")


def test_reply_times_from_the_first_text_chunk_and_counts_the_servers_tokens() -> None:
    chunk = lambda text: {"choices": [{"delta": {"content": text}}]}  # noqa: E731
    events = [
        (1.0, {"choices": [{"delta": {"role": "assistant"}}]}),  # no text: not the first token
        (1.5, chunk("Hel")),
        (2.0, chunk("lo")),
        (3.5, chunk("!")),
        (3.6, {"choices": [], "timings": {"predicted_n": 9, "draft_n": 6, "draft_n_accepted": 4}}),
        (3.7, {"choices": [], "usage": {"completion_tokens": 5}}),
    ]
    r = reply_from_events(events, t_sent=0.5)
    assert (r.text, r.tokens, r.ttft_s, r.decode_s) == ("Hello!", 5, 1.0, 2.0)  # usage wins over predicted_n
    assert r.tokens_per_s == pytest.approx(4 / 2.0)
    assert acceptance(r.timings) == (6, 4)
    no_usage = reply_from_events(events[:-1], t_sent=0.5)
    assert no_usage.tokens == 9  # llama-server's own count where usage is not sent
    with pytest.raises(MedusaChatError, match="error"):
        reply_from_events([(1.0, {"error": {"message": "context full"}})], 0.0)


def test_drafting_gives_tokens_per_step_from_accepted_drafts() -> None:
    t = ServerTally()
    t.replies = [
        Reply("a", 10, 0.1, 1.0, {"predicted_n": 10, "draft_n": 8, "draft_n_accepted": 5}),
        Reply("b", 11, 0.1, 1.0, {"predicted_n": 11, "draft_n": 6, "draft_n_accepted": 3}),
    ]
    d = t.drafting()
    assert d == {"draft_tokens": 14, "accepted_tokens": 8, "acceptance_rate": round(8 / 14, 4),
                 "tokens_per_step": round(21 / 13, 4)}  # fmt: skip
    assert t.tokens_per_s() == pytest.approx((9 + 10) / 2.0)
    assert ServerTally([Reply("x", 4, 0.1, 1.0, {"predicted_n": 4})]).drafting() is None


def test_argv_per_mode(tmp_path: Path) -> None:
    b, m = tmp_path / "llama-server", tmp_path / "m.gguf"
    plain = llama_server_argv(b, m, 2, 8080, "llamacpp-server", None)
    assert plain[:3] == [str(b), "-m", str(m)] and "-t" in plain and "--spec-type" not in plain
    assert plain[plain.index("-t") + 1] == "2" and plain[plain.index("--port") + 1] == "8080"
    assert llama_server_argv(b, m, 2, 1, "llamacpp-ngram", None)[-2:] == ["--spec-type", "ngram-mod"]
    eagle = llama_server_argv(b, m, 2, 1, "llamacpp-eagle3", tmp_path / "d.gguf")
    assert eagle[-4:] == ["-md", str(tmp_path / "d.gguf"), "--spec-type", "draft-eagle3"]


def _stub_binary(tmp_path: Path) -> Path:
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STUB}" "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def test_find_llama_server_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEDUSA_CHAT_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("MEDUSA_CHAT_LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_llama_server() is None
    binary = _stub_binary(tmp_path)
    bench = binary.with_name("llama-bench")
    assert find_llama_server(llama_bench=str(bench)) == binary  # beside llama-bench
    monkeypatch.setenv("MEDUSA_CHAT_LLAMA_SERVER", str(binary))
    assert find_llama_server() == binary
    assert find_llama_server(str(tmp_path / "missing")) == binary  # a missing explicit path falls through


def _fake_loaded(gguf: Path) -> SimpleNamespace:
    spec = SimpleNamespace(kind="gguf", backbone=str(gguf), heads=None)
    return SimpleNamespace(spec=spec, heads=None, heads_file="")


def _state(proc: subprocess.Popen[bytes] | None) -> str:
    """The process's state letter from /proc (T: stopped by a signal)."""
    assert proc is not None
    return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_servers_start_answer_and_stop_through_the_same_client(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # the stand-in never reads it
    peers, note = start_server_peers(_fake_loaded(gguf), 1, None, (str(_stub_binary(tmp_path)), None))
    assert note == "" and peers is not None
    try:
        assert peers.methods == ["llamacpp-server", "llamacpp-ngram"]  # no EAGLE-3 draft for this model
        assert all(srv.model == "stub.gguf" for srv in peers.servers.values())  # the id /v1/models lists
        assert any("llamacpp-eagle3 skipped" in n for n in peers.notes)
        assert {_state(srv.proc) for srv in peers.servers.values()} == {"T"}  # stopped while not answering
        peers.warm("hello", 4)
        rows = []
        for prompt in ("first prompt", "second"):
            for m in peers.methods:
                peers.run(m, prompt, 12)
            rows.append(peers.end_prompt())
        assert rows[0]["llamacpp-ngram"]["identical_to_llamacpp_plain"] is True
        assert rows[0]["llamacpp-ngram"]["accepted_tokens"] == 6 and "draft_tokens" not in rows[0]["llamacpp-server"]
        s = peers.summary(medusa_tokens_per_s=1.0)
        assert s["llamacpp_server_tokens_per_s"] > 0 and s["llamacpp_ngram_tokens_per_s"] > 0
        assert s["llamacpp_spec"]["llamacpp-ngram"]["drafting"]["tokens_per_step"] == 2.0
        assert s["llamacpp_spec"]["llamacpp-ngram"]["identical_to_llamacpp_plain_fraction"] == 1.0
        assert s["speedup_vs_best_llamacpp_mode"] is not None
        assert {_state(srv.proc) for srv in peers.servers.values()} == {"T"}
        procs = [srv.proc for srv in peers.servers.values()]
    finally:
        peers.close()
    assert all(p is not None and p.poll() is not None for p in procs)


def test_a_server_that_dies_is_dropped_with_a_note(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    peers, _ = start_server_peers(_fake_loaded(gguf), 1, None, (str(_stub_binary(tmp_path)), None))
    assert peers is not None
    try:
        server = peers.servers["llamacpp-ngram"]
        server.close()
        peers.run("llamacpp-ngram", "hi", 4)
        assert "llamacpp-ngram" not in peers.servers and any("llamacpp-ngram failed" in n for n in peers.notes)
    finally:
        peers.close()


def test_every_server_gets_the_benchs_repetition_settings(tmp_path: Path) -> None:
    from medusa_chat.events import GenerationSettings

    options = request_options(GenerationSettings(dry_multiplier=0.8, dry_allowed_length=4))
    assert options["dry_multiplier"] == 0.8 and options["dry_allowed_length"] == 4
    assert options["dry_sequence_breakers"] == ["\n", ":", '"', "*"] and options["repeat_penalty"] == 1.0
    assert request_options(GenerationSettings(dry_multiplier=0.0))["dry_multiplier"] == 0.0  # sent, not left out
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    texts = {}
    for dry in (0.0, 0.8):
        opts = request_options(GenerationSettings(dry_multiplier=dry))
        peers, _ = start_server_peers(_fake_loaded(gguf), 1, None, (str(_stub_binary(tmp_path)), None), opts)
        assert peers is not None
        try:
            peers.run("llamacpp-server", "hello", 4)
            texts[dry] = peers._current["llamacpp-server"].text
        finally:
            peers.close()
    assert texts[0.0].startswith("w5 ") and texts[0.8].startswith("w5dry ")  # the stand-in echoes DRY


def test_serve_is_compared_with_the_plain_loop_and_llama_cpp_modes_with_llama_server(tmp_path: Path) -> None:
    import tempfile

    peers = ServerPeers({}, [], tempfile.TemporaryDirectory(dir=tmp_path))
    peers.tally = {m: ServerTally() for m in (REFERENCE, "llamacpp-ngram", SERVE)}
    for plain_text, serve_text in (("a b", "a b"), ("a b", "a c")):
        peers._current = {REFERENCE: Reply("x y", 3, 0.1, 1.0, {}), "llamacpp-ngram": Reply("x y", 3, 0.1, 1.0, {}),
                          SERVE: Reply(serve_text, 3, 0.1, 1.0, {})}  # fmt: skip
        row = peers.end_prompt(plain_text)
    assert row[SERVE]["identical_to_plain_loop"] is False and "identical_to_plain_loop" not in row[REFERENCE]
    s = peers.summary(medusa_tokens_per_s=None)["llamacpp_spec"]
    assert s[SERVE]["identical_to_plain_loop_fraction"] == 0.5 and s[SERVE]["identical_to_llamacpp_plain_fraction"] == 0
    assert s["llamacpp-ngram"]["identical_to_llamacpp_plain_fraction"] == 1.0
    assert "identical_to_plain_loop_fraction" not in s["llamacpp-ngram"]
    peers.close()


def test_no_binary_skips_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEDUSA_CHAT_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("MEDUSA_CHAT_LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    peers, note = start_server_peers(_fake_loaded(tmp_path / "m.gguf"), 1, None, (None, None))
    assert peers is None and "llama-server" in note and "MEDUSA_CHAT_LLAMA_SERVER" in note


# ---- the real llama-server, where one is built --------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_llama_server() -> Path:
    from medusa_chat.model.sources.embedded import gguf_path

    binary = find_llama_server()
    if binary is None or gguf_path() is None:
        pytest.skip("no llama-server built (MEDUSA_CHAT_LLAMA_SERVER) or no embedded model GGUF")
    return binary


def test_real_llama_server_eagle3_with_the_exported_draft_equals_its_plain_decode(
    real_llama_server: Path, tmp_path: Path
) -> None:
    from medusa_chat.bench.api_client import ServerProcess, free_port
    from medusa_chat.model.sources.embedded import gguf_path

    loaded = SimpleNamespace(spec=SimpleNamespace(kind="embedded", heads=None), heads=None, heads_file="")
    draft = server_peers.eagle3_draft_gguf(loaded, tmp_path / "d.gguf")
    assert draft is not None
    threads = min(2, os.cpu_count() or 1)
    replies = {}
    for mode in ("llamacpp-server", "llamacpp-eagle3"):
        port = free_port()
        argv = llama_server_argv(real_llama_server, gguf_path(), threads, port, mode, draft)
        server = ServerProcess(mode, argv, port, tmp_path / f"{mode}.log").start()
        try:
            replies[mode] = stream_chat(server.url, "Name three colours of the rainbow.", 32, server.model)
        finally:
            server.close()
    assert replies["llamacpp-eagle3"].text == replies["llamacpp-server"].text
    drafted, accepted = acceptance(replies["llamacpp-eagle3"].timings)
    assert drafted > 0 and accepted > 0


def test_the_servers_table_shows_each_server_lossless_against_its_own_plain_decode() -> None:
    import io

    from rich.console import Console

    from medusa_chat.bench.report import print_servers

    row = {"tokens_per_s": 10.0, "vs_llamacpp_plain": 1.0, "drafting": None, "median_tokens_per_s": 10.0}
    summary = {
        "llamacpp_spec": {
            REFERENCE: {**row, "identical_to_llamacpp_plain_fraction": 1.0},
            SERVE: {**row, "identical_to_llamacpp_plain_fraction": 0.25, "identical_to_plain_loop_fraction": 1.0},
        },
        "medusa_serve_speedup_vs_best_llamacpp": 3.0,
    }
    out = io.StringIO()
    print_servers(Console(file=out, width=200), summary)
    text = out.getvalue()
    serve_line = next(line for line in text.splitlines() if "serve" in line and "x" in line and "%" in line)
    assert "100%" in serve_line and "25%" not in serve_line
    assert "25% of its replies equal" in " ".join(text.split()) and "3.00x" in text
