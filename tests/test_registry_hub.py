"""Registry, Hub access (offline cache, unreachable Hub, a local stand-in Hub server) and the CLI's own commands."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch

from medusa_chat import cli
from medusa_chat.errors import HeadsError, MedusaChatError, ModelNotFoundError, OfflineError
from medusa_chat.model.sources import hub
from medusa_chat.model.sources.loading import load_model
from medusa_chat.model.sources.registry import EMBEDDED_HEADS_DIR, MODELS, resolve
from tests.conftest import HubCache
from tests.tinymodels import folder_files

# ---- registry -------------------------------------------------------------------------------------------------------
EXPECTED = {
    "vicuna-7b": ("lmsys/vicuna-7b-v1.3", "FasterDecoding/medusa-vicuna-7b-v1.3", "v1-heads", "vicuna_v1.1", "vicuna_7b_stage2"),
    "vicuna-13b": ("lmsys/vicuna-13b-v1.3", "FasterDecoding/medusa-vicuna-13b-v1.3", "v1-heads", "vicuna_v1.1", "vicuna_13b_stage2"),
    "vicuna-33b": ("lmsys/vicuna-33b-v1.3", "FasterDecoding/medusa-vicuna-33b-v1.3", "v1-heads", "vicuna_v1.1", "vicuna_33b_stage2"),
    "vicuna-7b-v1.5": ("FasterDecoding/medusa-v1.0-vicuna-7b-v1.5", None, "full-medusa2", "vicuna_v1.1", "vicuna_7b_stage2"),
    "vicuna-13b-v1.5": ("FasterDecoding/medusa-1.0-vicuna-13b-v1.5", None, "full-medusa2", "vicuna_v1.1", "vicuna_13b_stage2"),
    "zephyr-7b": ("FasterDecoding/medusa-1.0-zephyr-7b-beta", None, "full-medusa2", "tokenizer", "zephyr_stage2"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(EXPECTED))
def test_registry_entries(name: str) -> None:
    spec = resolve(name)
    assert (spec.backbone, spec.heads, spec.kind, spec.chat_template, spec.default_tree) == EXPECTED[name]
    assert spec.download_gb > 1 and spec.params_b and not spec.custom
    from medusa_chat.tree import Tree

    assert Tree.named(spec.default_tree).size == 64


def test_embedded_entry_and_default() -> None:
    spec = resolve(None)
    assert spec.name == "smollm2-135m" and spec.kind == "embedded" and spec.chat_template == "tokenizer"
    assert Path(spec.heads) == EMBEDDED_HEADS_DIR and spec.heads.endswith("assets/smollm2-135m")
    # The Hub original of the embedded model gets the embedded heads by default.
    original = resolve("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert original.backbone == "HuggingFaceTB/SmolLM2-135M-Instruct" and original.heads == spec.heads


def test_unknown_alias_lists_the_aliases() -> None:
    with pytest.raises(
        ModelNotFoundError, match=r"unknown model 'vicuna-70b': use one of smollm2-135m, vicuna-7b"
    ):
        resolve("vicuna-70b")
    with pytest.raises(ModelNotFoundError, match="heads folder './nowhere' does not exist"):
        resolve("vicuna-7b", "./nowhere")


def test_custom_models_and_heads(
    v1_safetensors_heads_dir: Path, v2_heads_dir: Path, tiny_llama_dir: Path
) -> None:
    repo = resolve("some-org/some-model", "other-org/heads")
    assert repo.custom and repo.backbone == "some-org/some-model" and repo.heads == "other-org/heads"
    assert repo.default_tree == "mc_sim_7b_63"
    local = resolve(str(tiny_llama_dir), str(v1_safetensors_heads_dir))
    assert local.default_tree == str(v1_safetensors_heads_dir / "tree.json")  # the heads' own tree
    assert resolve(str(tiny_llama_dir), str(v2_heads_dir)).kind == "v2-heads"
    mixed = resolve("vicuna-7b", str(v2_heads_dir))
    assert mixed.backbone == "lmsys/vicuna-7b-v1.3" and mixed.chat_template == "vicuna_v1.1" and mixed.custom
    assert resolve("some-org/medusa2-model").kind == "full-medusa2"  # provisional until its config is read


# ---- file selection -------------------------------------------------------------------------------------------------
def test_select_files_takes_only_what_is_needed() -> None:
    repo = [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json",
        "consolidated.safetensors", "onnx/model.onnx", "medusa_lm_head.pt", "medusa_lm_head.safetensors",
    ]  # fmt: skip
    model = hub.select_files(repo, "model")
    assert model == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    ]  # fmt: skip
    bin_only = [n for n in repo if "safetensors" not in n]
    assert "pytorch_model.bin.index.json" in hub.select_files(bin_only, "model")
    assert hub.select_files(repo, "heads") == ["config.json", "medusa_lm_head.safetensors"]
    assert hub.select_files(bin_only, "heads") == ["config.json", "medusa_lm_head.pt"]
    assert hub.select_files(["config.json", "README.md"], "model") == []
    assert hub.select_files(["config.json"], "heads") == []


def test_disk_space_check(tmp_path: Path) -> None:
    hub.check_disk_space(tmp_path, 1000, "org/small")
    with pytest.raises(
        MedusaChatError, match=r"not enough disk space to download org/huge: it needs 1000\.0 TB"
    ):
        hub.check_disk_space(tmp_path / "not" / "yet", 10**15, "org/huge")


# ---- offline cache --------------------------------------------------------------------------------------------------
def test_offline_load_from_hub_cache(hub_cache: HubCache) -> None:
    r = hub_cache.repos
    snapshot = hub.fetch(r["backbone"], "model")
    assert snapshot.parent.name == "snapshots" and (snapshot / "model.safetensors").is_file()
    loaded = load_model(model=r["backbone"], heads=r["heads"], device="cpu")
    assert loaded.heads.num_heads == 5 and loaded.spec.kind == "v1-heads"
    # The heads repo alone: its config names the backbone repo, also found in the cache.
    assert load_model(model=r["heads"], device="cpu").spec.backbone == r["backbone"]
    full = load_model(model=r["full"], device="cpu")
    assert full.spec.kind == "full-medusa2" and full.heads.num_heads == 3


def test_offline_missing_repo_says_how_to_get_it(hub_cache: HubCache) -> None:
    t0 = time.monotonic()
    with pytest.raises(OfflineError) as err:
        load_model(model="tiny-org/not-here", heads=hub_cache.repos["heads"], device="cpu")
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "tiny-org/not-here is not in the Hugging Face cache" in msg and "HF_HUB_OFFLINE is set" in msg
    assert "huggingface-cli download tiny-org/not-here" in msg and "unset HF_HUB_OFFLINE" in msg
    assert "\n" not in msg


def test_offline_partial_snapshot_names_missing_files(
    hub_cache: HubCache, medusa2_safetensors_dir: Path
) -> None:
    with pytest.raises(
        OfflineError, match=r"tiny-llama-partial: the cached copy .* has no config.json and model weights"
    ):
        hub.fetch(hub_cache.repos["partial"], "model")
    hub_cache.add(
        "tiny-org/half", folder_files(medusa2_safetensors_dir, skip=("model-00002-of-00002.safetensors",))
    )
    with pytest.raises(
        OfflineError, match=r"tiny-org/half: 1 needed file\(s\) .*\(model-00002-of-00002\.safetensors\)"
    ):
        hub.fetch("tiny-org/half", "model")
    with pytest.raises(OfflineError, match="has no medusa_lm_head.safetensors or medusa_lm_head.pt"):
        hub.fetch(hub_cache.repos["backbone"], "heads")


def test_unreachable_hub_fails_fast_and_uses_the_cache(
    hub_cache: HubCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused at once
    hub.forget_reachability()
    t0 = time.monotonic()
    assert not hub.hub_reachable()
    with pytest.raises(OfflineError, match=r"the Hub \(http://127\.0\.0\.1:9\) cannot be reached"):
        hub.fetch("tiny-org/not-here", "model")
    assert time.monotonic() - t0 < 5  # no 23-second retry loop
    assert load_model(model=hub_cache.repos["backbone"], heads=hub_cache.repos["heads"], device="cpu")


# ---- online, against a local stand-in for the Hub -----------------------------------------------------------------
class FakeHub(http.server.ThreadingHTTPServer):
    """Serves the two Hub endpoints huggingface_hub uses here: the model info API and /resolve/ file URLs."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _FakeHubHandler)
        self.repos: dict[str, dict[str, bytes]] = {}
        self.downloads: list[str] = []
        self.gated: set[str] = set()  # repos whose files answer 401 GatedRepo (their listing stays public)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def sha(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()


class _FakeHubHandler(http.server.BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = unquote(urlparse(self.path).path)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/.+)?", path):
            repo = m.group(1)
            if repo not in self.server.repos:
                return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            files = self.server.repos[repo]
            info = {
                "id": repo,
                "sha": self.server.sha(repo),
                "siblings": [{"rfilename": n, "size": len(b)} for n, b in files.items()],
            }
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, _, name = m.groups()
            if repo in self.server.gated:  # as the Hub answers a user who has not accepted the licence
                message = f"Access to model {repo} is restricted. You must have access to it and be authenticated."
                return self._send(401, b"", {"X-Error-Code": "GatedRepo", "X-Error-Message": message})
            data = self.server.repos.get(repo, {}).get(name)
            if data is None:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
            if self.command == "GET":
                self.server.downloads.append(f"{repo}/{name}")
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            return self._send(200, data, {"X-Repo-Commit": self.server.sha(repo), "ETag": etag})
        return self._send(404)


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    import huggingface_hub.constants

    server = FakeHub()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # it was read at import time
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    hub.forget_reachability()
    yield server
    server.shutdown()
    server.server_close()
    hub.forget_reachability()


def test_download_only_needed_files_then_reuse_offline(
    fake_hub: FakeHub, tiny_llama_dir: Path, v1_pt_heads_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_files = {n: Path(p).read_bytes() for n, p in folder_files(tiny_llama_dir).items()}
    fake_hub.repos["org/tiny"] = {
        **model_files,
        "pytorch_model.bin": b"x" * 1000,  # a second copy in the old format: must not be fetched
        "onnx/model.onnx": b"y" * 10,
        "README.md": b"# tiny",
    }
    heads_cfg = json.loads((v1_pt_heads_dir / "config.json").read_text()) | {
        "base_model_name_or_path": "org/tiny"
    }
    fake_hub.repos["org/tiny-medusa"] = {
        "config.json": json.dumps(heads_cfg).encode(),
        "medusa_lm_head.pt": (v1_pt_heads_dir / "medusa_lm_head.pt").read_bytes(),
        "README.md": b"# heads",
    }
    assert hub.hub_reachable()
    lines: list[str] = []
    loaded = load_model(model="org/tiny-medusa", device="cpu", progress=lines.append)
    assert loaded.heads.num_heads == 5 and loaded.spec.backbone == "org/tiny"
    fetched = sorted(fake_hub.downloads)
    assert "org/tiny/model.safetensors" in fetched and "org/tiny-medusa/medusa_lm_head.pt" in fetched
    assert not any(n.endswith(("pytorch_model.bin", "model.onnx", "README.md")) for n in fetched)
    assert any(re.match(r"Downloading 5 file\(s\), [\d.]+ (KB|MB), from org/tiny$", line) for line in lines)
    assert any(
        re.match(r"Downloading org/tiny: \S+ — [\d.]+ (B|KB) of [\d.]+ KB \(\d+%\)$", line) for line in lines
    )
    assert any(line.startswith("Downloaded org/tiny") for line in lines)

    # Second run: everything comes from the cache.
    fake_hub.downloads.clear()
    hub.fetch("org/tiny", "model", bars=True)
    assert fake_hub.downloads == []

    # Offline afterwards: the same names load from the cache (refs/main was written).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = load_model(model="org/tiny", heads="org/tiny-medusa", device="cpu")
    assert again.quant == loaded.quant  # one numeric-path choice per backbone, however it is named
    with torch.no_grad():
        ids = torch.tensor([again.build_prompt([{"role": "user", "content": "hi"}])])
        torch.testing.assert_close(again.backbone(ids).logits, loaded.backbone(ids).logits)


def test_online_errors(fake_hub: FakeHub, tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="org/missing was not found on the Hub"):
        hub.fetch("org/missing", "model")
    fake_hub.repos["org/plain"] = {n: Path(p).read_bytes() for n, p in folder_files(tiny_llama_dir).items()}
    with pytest.raises(HeadsError, match="org/plain has no Medusa heads file"):
        hub.fetch("org/plain", "heads")
    # a Hub model without heads is still a chat (context lookup only), and says how to get heads for it
    loaded = load_model(model="org/plain", device="cpu", quant="none")
    assert loaded.heads is None and loaded.spec.kind == "no-heads"
    assert "`medusa-chat train-heads --model org/plain`" in loaded.info()["heads"]["note"]


# ---- cache listing and the CLI ----------------------------------------------------------------------------------------
def test_models_lists_registry_with_cache_state(
    hub_cache: HubCache, tiny_llama_dir: Path, v1_pt_heads_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repos = hub.cached_repos()
    assert {"tiny-org/tiny-llama", "tiny-org/tiny-llama-medusa"} <= set(repos)
    assert repos["tiny-org/tiny-llama"].size_on_disk > 100_000
    # Pretend vicuna-7b was downloaded (tiny stand-in files under the real repo names).
    hub_cache.add("lmsys/vicuna-7b-v1.3", folder_files(tiny_llama_dir))
    hub_cache.add("FasterDecoding/medusa-vicuna-7b-v1.3", folder_files(v1_pt_heads_dir))
    hub_cache.add("lmsys/vicuna-13b-v1.3", {"config.json": b"{}"})
    assert cli.main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(MODELS)
    assert rows["vicuna-7b"]["complete"] and rows["vicuna-7b"]["local"].startswith("cached")
    assert rows["vicuna-13b"]["local"].startswith("partial") and not rows["vicuna-13b"]["complete"]
    assert rows["zephyr-7b"]["local"] == "-"
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "vicuna-7b" in out and "zephyr-7b" in out and "offline mode" in out


def test_cli_info_json_and_text(
    tiny_llama_dir: Path, v1_safetensors_heads_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "info",
        "--model",
        str(tiny_llama_dir),
        "--heads",
        str(v1_safetensors_heads_dir),
        "--device",
        "cpu",
    ]
    assert cli.main([*args, "--json", "--tree-size", "5"]) == 0
    info = json.loads(capsys.readouterr().out)
    # --quant auto on a CPU: the path measured fastest here (the same choice chat makes, cached)
    assert (
        info["heads"]["count"] == 4
        and info["quant"] in ("none", "int8", "int4")
        and info["tree"]["size"] == 5
    )
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "4 Medusa heads" in out and "heads-v1-st-tree" in out


def test_cli_errors_are_one_line(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--model", "vicuna-70b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'vicuna-70b'") and err.count("\n") == 1
    assert "Traceback" not in err
    # heads that are asked for must be there (a model without any heads is fine: context lookup only)
    assert cli.main(["info", "--model", str(tiny_llama_dir), "--heads", "/no/such/heads", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: heads folder '/no/such/heads' does not exist") and err.count("\n") == 1
    if not torch.cuda.is_available():
        assert cli.main(["info", "--device", "cuda", "--quant", "nf4"]) == 2
        assert capsys.readouterr().err.startswith("error: --device cuda was asked for but no CUDA GPU")


def test_cli_parser_shape() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--model", "vicuna-7b", "--quant", "nf4", "--tree-size", "16"])
    assert (args.command, args.model, args.quant, args.tree_size, args.trust_remote_code) == (
        "bench", "vicuna-7b", "nf4", 16, False
    )  # fmt: skip
    for name in ("chat", "web", "ask", "train-heads", "fit-tree", "calibrate", "info"):
        assert parser.parse_args([name]).dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["info", "--quant", "gptq"])
