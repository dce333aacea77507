"""A big model on a CPU: the product's own `--model vicuna-7b` offline ends in the Hub cache's message (the CLI's
`info` and the web page alike), never in a refusal about RAM; a model this machine cannot hold is refused with what
is missing, except by `info`, which tells it; a GGUF file loads after one line of the memory and speed to expect;
and the web page's chat area shows a failed load and its fix, once."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GRADIO_TEMP_DIR", tempfile.mkdtemp(prefix="medusa-gradio-test-"))

from medusa_chat import cli  # noqa: E402
from medusa_chat.chat.session import SessionManager, SessionOptions  # noqa: E402
from medusa_chat.errors import OfflineError  # noqa: E402
from medusa_chat.model.sources.cpu_plan import WontFit  # noqa: E402
from medusa_chat.model.sources.loading import load_model  # noqa: E402
from tests.conftest import HubCache  # noqa: E402

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path")
NOT_CACHED = "is not in the Hugging Face cache"


@no_gpu
def test_vicuna_7b_offline_info_says_not_in_the_cache(
    hub_cache: HubCache, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info", "--model", "vicuna-7b"]) == 0  # info tells, never refuses
    out = "".join(capsys.readouterr())
    assert NOT_CACHED in out and "lmsys/vicuna-7b-v1.3" in out
    assert "would download" in out or "downloads" in out  # what its first run fetches, and how big
    assert "GB of RAM" not in out and "--device cpu" not in out


@no_gpu
def test_vicuna_7b_offline_web_page_shows_the_failure_and_its_fix_once(hub_cache: HubCache, tmp_path: Path) -> None:
    """What `python run.py --model vicuna-7b` serves offline: the load fails with the Hub cache's message, the model
    panel says so once, and the chat area (not "Ask anything") holds it with what to do; reloading the page does not
    retry the load and log the failure again."""
    from medusa_chat.ui import web

    app = web.WebApp(SessionManager(SessionOptions(model="vicuna-7b"), tmp_path))
    app.loader.start()
    assert app.loader.wait(120) and app.loader.status == "error"
    assert NOT_CACHED in (app.loader.error or "")
    app.page_load()
    app.page_load()
    assert app.loader.status == "error"
    assert sum(NOT_CACHED in line for line in app.loader.lines) == 1
    assert app.model_panel().count(NOT_CACHED) == 1
    chat = app.history()
    assert len(chat) == 1 and chat[0]["role"] == "assistant"
    assert "did not load" in chat[0]["content"] and "Load / retry" in chat[0]["content"]
    assert "hf download lmsys/vicuna-7b-v1.3" in chat[0]["content"]  # the fix the error names
    panel, _, tick_chat = app.tick()
    assert tick_chat == chat and "failed to load" in panel


def _huge_folder(tmp_path: Path) -> Path:
    """A config.json of a ~1.7T-parameter Llama: 4-bit, more memory and disk than any test machine has."""
    big = tmp_path / "llama-huge"
    big.mkdir()
    cfg = dict(model_type="llama", hidden_size=16384, intermediate_size=65536, num_hidden_layers=400,
               num_attention_heads=128, vocab_size=32000)  # fmt: skip
    (big / "config.json").write_text(json.dumps(cfg))
    return big


@no_gpu
def test_a_model_this_machine_cannot_hold_is_refused_with_what_is_missing(tmp_path: Path) -> None:
    said: list[str] = []
    with pytest.raises(WontFit, match=r"does not fit on this machine 4-bit: [\d.]+ [TGM]B of RAM .* missing"):
        load_model(model=str(_huge_folder(tmp_path)), progress=said.append)
    assert any("4-bit (int4)" in s and "of RAM" in s for s in said)  # the line came first


@no_gpu
def test_info_tells_what_is_missing_and_never_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--model", str(_huge_folder(tmp_path))]) == 0
    out = capsys.readouterr()
    assert "does not fit on this machine 4-bit" in out.out and "missing" in out.out
    assert "4-bit (int4)" in out.err  # the expected memory and speed


def test_a_gguf_file_loads_after_one_line_of_memory_and_speed(tmp_path: Path) -> None:
    from tests.tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny-q4.gguf", "Q4_1", "Q8_0")
    said: list[str] = []
    loaded = load_model(model=str(gguf), progress=said.append)
    lines = [s for s in said if "of RAM" in s]
    assert len(lines) == 1 and "4-bit (its blocks as stored)" in lines[0] and "tokens/s" in lines[0]
    # no calibration of this file on this CPU yet: the speed is the project's figures, named as such
    assert "the project's measurements" in lines[0] or "measured on this CPU" in lines[0]
    assert loaded.quant == "gguf"


def test_a_missing_registry_model_is_the_cache_message_not_a_size_refusal(hub_cache: HubCache) -> None:
    with pytest.raises(OfflineError, match=NOT_CACHED):
        load_model(model="vicuna-7b")
