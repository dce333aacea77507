"""A Hugging Face checkpoint on a CPU block path (int4 / int8) is quantized tensor by tensor into a cached GGUF and
loaded from it (model/sources/quantized_cache.py): the same blocks, bit for bit, as quantizing the whole float model in
memory, hence the same greedy output (and the plain loop's); the second start reads the file; a damaged file is
made again; a failed write leaves nothing behind. Pickled checkpoints (.bin) take the same path through their
memory map."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.errors import MedusaChatError
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.kernels import block_linears, cbind
from medusa_chat.kernels.gguf_file import read_tensors
from medusa_chat.model.mapped_weights import load_pickle, release
from medusa_chat.model.sources import quantized_cache
from medusa_chat.model.sources.loading import LoadedModel, load_model
from medusa_chat.tree import Tree
from tests.tinymodels import write_pickled_checkpoint

pytestmark = pytest.mark.skipif(not cbind.available(), reason="block kernel not available here")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cache" / "models"


@pytest.fixture(scope="module")
def tied_llama_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama in fp16 (as most published checkpoints) with tie_word_embeddings (no lm_head.weight in its
    safetensors)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tied") / "tiny-llama-tied"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.half().save_pretrained(out)
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def _load(path: Path, quant: str, cached: bool, progress: list[str] | None = None) -> LoadedModel:
    return load_model(
        str(path),
        quant=quant,
        device="cpu",
        progress=progress.append if progress is not None else None,
        quantized_cache=cached,
    )


def _buffers(model: Any) -> dict[str, torch.Tensor]:
    """Every tensor that decides the model's numbers: the block linears' buffers, the embedding, the norms."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, block_linears.BlockLinear):
            out.update({f"{name}.{b}": getattr(module, b) for b in module.buffer_names})
    embed = model.get_input_embeddings()
    out["embed"] = embed(torch.arange(embed.num_embeddings))  # every row as looked up
    out.update({n: p for n, p in model.named_parameters() if "norm" in n})
    return out


def _reply(loaded: LoadedModel, tree: Tree, prompt: list[int], n: int = 20) -> list[int]:
    for event in MedusaEngine(loaded, tree).generate(prompt, GenerationSettings(max_new_tokens=n, temperature=0)):
        if isinstance(event, ReplySummary):
            return event.token_ids
    raise AssertionError("no summary")


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_blocks_and_the_replies_are_the_in_memory_paths(
    quant: str, tied: bool, tiny_llama_dir: Path, tied_llama_dir: Path, cache: Path
) -> None:
    path = tied_llama_dir if tied else tiny_llama_dir
    progress: list[str] = []
    new = _load(path, quant, True, progress)
    old = _load(path, quant, False)
    assert any(f"Quantizing {path} once to {quant} blocks" in p for p in progress), progress
    assert any("cached quantized file" in n for n in new.notes), new.notes
    assert not any("cached quantized file" in n for n in old.notes)
    mine, ref = _buffers(new.backbone), _buffers(old.backbone)
    assert mine.keys() == ref.keys() and len(mine) > 10
    for name in ref:
        assert mine[name].dtype == ref[name].dtype and torch.equal(mine[name], ref[name]), name
    assert new.info()["params"] == old.info()["params"]
    if tied:  # the checkpoint's fp16 embedding stays fp16 in memory (rows widened as looked up)
        assert new.backbone.get_input_embeddings().raw.numel() * 2 == old.backbone.get_input_embeddings().weight.nbytes
    prompts = [new.build_prompt([{"role": "user", "content": "Tell me about the sea."}]), [5, 6, 7, 300]]
    for prompt in prompts:
        want = _reply(old, plain_tree(), prompt)
        assert _reply(new, plain_tree(), prompt) == want
        assert _reply(new, Tree.chain(3), prompt) == want  # tree steps: the plain loop's reply


def test_the_second_start_maps_the_file_and_a_damaged_one_is_made_again(tiny_llama_dir: Path, cache: Path) -> None:
    first: list[str] = []
    a = _load(tiny_llama_dir, "int4", True, first)
    files = list(cache.glob("hfq-*.gguf"))
    assert len(files) == 1 and any("Quantizing" in p for p in first)
    again: list[str] = []
    b = _load(tiny_llama_dir, "int4", True, again)
    assert not any("Quantizing" in p for p in again), again
    assert any("quantized from the checkpoint once" in n for n in b.notes)
    prompt = [5, 6, 7, 300]
    want = _reply(a, plain_tree(), prompt)
    # a truncated file (a crash of some other writer, a full disk when it was copied) is noticed and made again
    data = files[0].read_bytes()
    files[0].write_bytes(data[: len(data) - 100])
    third: list[str] = []
    c = _load(tiny_llama_dir, "int4", True, third)
    assert any("Quantizing" in p for p in third)
    assert files[0].stat().st_size == len(data) and _reply(c, plain_tree(), prompt) == want
    # another quantization or another checkpoint file content: another file
    _load(tiny_llama_dir, "int8", True)
    assert len(list(cache.glob("hfq-*.gguf"))) == 2


def test_medusa2_heads_stay_out_of_the_file(medusa2_safetensors_dir: Path, cache: Path) -> None:
    new = _load(medusa2_safetensors_dir, "int4", True)
    (path,) = cache.glob("hfq-*.gguf")
    names = set(read_tensors(path))
    assert names and not any("medusa" in n for n in names)
    assert "output.weight" in names and "token_embd.weight" in names
    assert new.heads is not None and new.heads_source == "medusa-2 checkpoint"
    old = _load(medusa2_safetensors_dir, "int4", False)
    prompt = new.build_prompt([{"role": "user", "content": "hi"}])
    want = _reply(old, plain_tree(), prompt)
    assert _reply(new, plain_tree(), prompt) == want
    assert _reply(new, Tree.named("mc_sim_7b_63").prefix(12), prompt) == want


def test_a_failed_write_leaves_no_file(
    tiny_llama_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = quantized_cache.tensor_bytes
    calls = []

    def failing(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(quantized_cache, "tensor_bytes", failing)
    loaded = _load(tiny_llama_dir, "int4", True)
    assert list(cache.iterdir()) == []  # no half file, no temporary
    assert any("could not be written" in n for n in loaded.notes)  # loaded the old way instead
    assert isinstance(loaded.backbone.model.layers[0].self_attn.q_proj, block_linears.Q41Linear)
    # too little free disk is known before anything is written
    monkeypatch.setattr(quantized_cache, "tensor_bytes", real)
    monkeypatch.setattr(quantized_cache.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 10))
    loaded = _load(tiny_llama_dir, "int4", True)
    assert any("could not be written" in n and "free" in n for n in loaded.notes)
    assert list(cache.iterdir()) == []


def test_what_does_not_take_this_path(tiny_llama_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _load(tiny_llama_dir, "none", True)
    assert not cache.exists() or not list(cache.glob("hfq-*"))
    monkeypatch.setenv(quantized_cache.ENV_SWITCH, "0")
    loaded = _load(tiny_llama_dir, "int4", True)
    assert not any("cached quantized file" in n for n in loaded.notes)
    assert not cache.exists() or not list(cache.glob("hfq-*"))


# ---- pickled (.bin) checkpoints ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["single", "sharded", "tied-legacy"])
def test_a_pickled_checkpoint_is_quantized_as_its_safetensors_twin(
    layout: str, tiny_llama_dir: Path, tied_llama_dir: Path, cache: Path, tmp_path: Path
) -> None:
    """pytorch_model.bin (fp32), 3 shards + index, and a tied fp16 model in the pre-zip pickle format (read without
    a map): the same blocks and the same greedy replies as the same weights in safetensors; made once, then read."""
    source = tied_llama_dir if layout == "tied-legacy" else tiny_llama_dir
    folder = write_pickled_checkpoint(
        source, tmp_path / layout, shards=3 if layout == "sharded" else 1, legacy=layout == "tied-legacy"
    )
    assert not list(folder.glob("*.safetensors"))
    ref = _load(source, "int4", True)
    first: list[str] = []
    new = _load(folder, "int4", True, first)
    assert any(f"Quantizing {folder} once to int4 blocks" in p for p in first), first
    assert any("cached quantized file" in n for n in new.notes), new.notes
    mine, want = _buffers(new.backbone), _buffers(ref.backbone)
    assert mine.keys() == want.keys() and len(mine) > 10
    for name in want:
        assert mine[name].dtype == want[name].dtype and torch.equal(mine[name], want[name]), name
    prompts = [new.build_prompt([{"role": "user", "content": "Tell me about the sea."}]), [5, 6, 7, 300]]
    for prompt in prompts:
        reply = _reply(ref, plain_tree(), prompt)
        assert _reply(new, plain_tree(), prompt) == reply
        assert _reply(new, Tree.chain(3), prompt) == reply
    assert len(list(cache.glob("hfq-*.gguf"))) == 2  # the safetensors twin's and this one's
    again: list[str] = []
    b = _load(folder, "int4", True, again)
    assert not any("Quantizing" in p for p in again), again
    assert len(list(cache.glob("hfq-*.gguf"))) == 2
    assert _reply(b, plain_tree(), prompts[1]) == _reply(ref, plain_tree(), prompts[1])


def test_the_cache_key_names_the_pickled_files_and_safetensors_win(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = write_pickled_checkpoint(tiny_llama_dir, tmp_path / "bin", shards=2)
    source = quantized_cache.source_identity(folder, "int4", torch.float32)
    shards = sorted(p.name for p in folder.glob("pytorch_model-*.bin"))
    assert [f[0] for f in source["files"]] == shards and len(shards) == 2
    assert [f[1] for f in source["files"]] == [(folder / s).stat().st_size for s in shards]
    shutil.copy(tiny_llama_dir / "model.safetensors", folder / "model.safetensors")
    assert quantized_cache.checkpoint_files(folder) == [folder / "model.safetensors"]


@pytest.mark.parametrize("shards", [1, 2])
def test_a_damaged_pickled_checkpoint_is_a_one_line_error_naming_it(
    shards: int, tiny_llama_dir: Path, cache: Path, tmp_path: Path
) -> None:
    folder = write_pickled_checkpoint(tiny_llama_dir, tmp_path / "bin", shards=shards)
    victim = sorted(folder.glob("pytorch_model*.bin"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(MedusaChatError) as info:
        _load(folder, "int4", True)
    message = str(info.value)
    assert f"cannot read {victim}: the file is truncated or corrupt" in message and "\n" not in message
    assert not cache.exists() or not list(cache.glob("hfq-*"))


def mapped_file_kb() -> int:
    """This process's resident pages of mapped files: RssFile for a file on a disk, RssShmem where the temp folder
    is a tmpfs (as /tmp is on many systems)."""
    with open("/proc/self/status") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("RssFile:", "RssShmem:")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_release_gives_back_a_mapped_tensors_pages_and_keeps_its_values(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(1024, 2048)}, tmp_path / "w.bin")  # 8 MB
    state, mapped = load_pickle(tmp_path / "w.bin", MedusaChatError)
    assert mapped and isinstance(state, dict)
    total = float(state["w"].sum())  # every page touched
    before = mapped_file_kb()
    assert release(state["w"]) >= (8 << 20) - 8192
    assert mapped_file_kb() < before - 6000
    assert float(state["w"].sum()) == total  # read again from the file
    heap = torch.randn(1 << 20)
    copy = heap.clone()
    assert release(heap) == 0 and torch.equal(heap, copy)  # never memory that is not a file's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_quantizing_a_mapped_weight_gives_its_pages_back_as_it_goes(tmp_path: Path) -> None:
    """quantize_q8_0 reads a file-mapped weight chunk by chunk and gives each chunk's pages back (block_heads
    passes mapped_weights.release): a published
    Medusa-1 head's 32,000 x 4,096 projection is never resident whole beside its blocks (7B + 5 heads: peak RSS
    6.85 -> 6.06 GB while loading). The codes are the same bits as from a copy in memory."""
    from medusa_chat.kernels.quantizers import quantize_q8_0

    torch.save({"w": torch.randn(4096, 2048).half()}, tmp_path / "w.bin")  # 16 MB
    state, mapped = load_pickle(tmp_path / "w.bin", MedusaChatError)
    assert mapped and isinstance(state, dict)
    quantize_q8_0(torch.randn(4096, 2048).half())  # (the code it runs paged in first: libraries are files too)
    before = mapped_file_kb()
    codes, d = quantize_q8_0(state["w"], release)
    assert mapped_file_kb() < before + 4000  # (16,000 kB if the pages stayed)
    want_codes, want_d = quantize_q8_0(state["w"].clone())
    assert torch.equal(codes, want_codes) and torch.equal(d, want_d)
