"""The peer a CPU user would pick instead: llama.cpp's token generation on the same GGUF, same machine.

`medusa-chat bench --baselines ...,llamacpp` runs llama.cpp's own benchmark tool (`llama-bench`, built from
llama.cpp or the llama-cpp-python sdist; an optional tool, never a dependency) in the same run as the other
methods: one run per prompt, in the same rotation as the other methods (a shared machine's speed drifts by
+-20% over minutes: a peer measured at other times than the methods is not side by side), with the same thread
count, and reports its token-generation rate (`-p 0 -n N`: N tokens decoded one at a time after an empty
prompt, so its context is shorter than the bench prompts'; if anything that favours llama.cpp). Where no binary or no GGUF is available the baseline is
skipped with a note saying why.

Where to find the binary: `--llamacpp-bench PATH`, else $MEDUSA_CHAT_LLAMA_BENCH, else `llama-bench` on PATH.
Without a binary, an installed llama-cpp-python (`import llama_cpp`) is the peer instead: the same GGUF loaded
in-process, and each bench prompt decoded greedily with its `generate` (the bench's own prompts and reply
length, timed from the first new token like every other method: side by side in the strictest sense).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medusa_chat import envvars


@dataclass
class LlamaBench:
    binary: Path
    gguf: Path
    threads: int

    def token_generation(
        self, tokens: int, reps: int = 3, timeout_s: float = 600, prompt_ids: Sequence[int] | None = None
    ) -> dict[str, Any]:
        """Run `llama-bench -p 0 -n tokens`; returns {tokens_per_s, stddev, build, model_type}. (llama-bench
        decodes after an empty prompt: `prompt_ids` is not used.)"""
        cmd = [
            str(self.binary), "-m", str(self.gguf), "-t", str(self.threads), "-p", "0", "-n", str(tokens),
            "-r", str(reps), "-o", "json",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"llama-bench failed ({done.returncode}): {tail[0][:200]}")
        return parse_llama_bench_json(done.stdout)


@dataclass
class LlamaCppPython:
    """The peer through llama-cpp-python: the GGUF loaded once, greedy decoding of the bench's own prompts."""

    gguf: Path
    threads: int
    context: int = 2048
    _llm: Any = field(default=None, repr=False)

    def _model(self) -> Any:
        if self._llm is None:
            try:
                import llama_cpp
            except ImportError as err:  # installed (found) but broken, e.g. a missing dependency
                raise RuntimeError(f"llama-cpp-python does not import: {err}") from err
            self._llm = llama_cpp.Llama(
                model_path=str(self.gguf),
                n_threads=self.threads,
                n_threads_batch=self.threads,
                n_ctx=self.context,
                verbose=False,
            )
        return self._llm

    def token_generation(
        self, tokens: int, reps: int = 1, timeout_s: float = 600, prompt_ids: Sequence[int] | None = None
    ) -> dict[str, Any]:
        """Decode `tokens` tokens greedily after `prompt_ids` (default: the BOS token), `reps` times; the rate
        counts the tokens after the first (the prefill and first token are excluded, as for every method)."""
        llm = self._model()
        prompt = list(prompt_ids) if prompt_ids else [llm.token_bos()]
        if len(prompt) + tokens > self.context:
            raise RuntimeError(f"prompt + reply ({len(prompt) + tokens} tokens) exceed llama.cpp's context")
        rates = []
        for _ in range(reps):
            made, t_first = 0, time.perf_counter()
            for _token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
                made += 1
                if made == 1:
                    t_first = time.perf_counter()
                if made >= tokens:
                    break
            elapsed = time.perf_counter() - t_first
            if made < 2 or elapsed <= 0:
                raise RuntimeError("llama-cpp-python produced fewer than 2 tokens")
            rates.append((made - 1) / elapsed)
        mean = sum(rates) / len(rates)
        spread = (sum((r - mean) ** 2 for r in rates) / len(rates)) ** 0.5
        return {
            "tokens_per_s": mean,
            "stddev": spread,
            "build": f"llama-cpp-python {getattr(sys.modules.get('llama_cpp'), '__version__', '?')}",
            "model_type": None,
            "n_gen": tokens,
            "threads": self.threads,
            "prompt_tokens": len(prompt),
        }


def parse_llama_bench_json(text: str) -> dict[str, Any]:
    """llama-bench's `-o json` output: a list of test records; the token-generation one has n_gen > 0."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise RuntimeError(f"llama-bench printed no JSON: {text[:120]!r}") from err
    tg = [r for r in records if int(r.get("n_gen", 0)) > 0 and int(r.get("n_prompt", 0)) == 0]
    if not tg:
        raise RuntimeError("llama-bench output has no token-generation test")
    r = tg[0]
    return {
        "tokens_per_s": float(r["avg_ts"]),
        "stddev": float(r.get("stddev_ts", 0.0)),
        "build": r.get("build_commit"),
        "model_type": r.get("model_type"),
        "n_gen": int(r["n_gen"]),
        "threads": int(r.get("n_threads", 0)),
    }


def find_llama_bench(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    for candidate in (explicit, envvars.value("MEDUSA_CHAT_LLAMA_BENCH"), shutil.which("llama-bench")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def model_gguf(loaded: Any) -> Path | None:
    """The GGUF the loaded model was made from (the embedded model's, or the file `--model` named), else None."""
    spec = getattr(loaded, "spec", None)
    if getattr(spec, "kind", None) == "gguf":
        return Path(spec.backbone)
    if getattr(spec, "kind", None) == "embedded":
        from medusa_chat.model.sources.embedded import gguf_path

        return gguf_path()
    return None


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_bench_for(
    loaded: Any, threads: int, explicit: str | None = None
) -> tuple[LlamaBench | LlamaCppPython | None, str]:
    """(runner, "") or (None, why the llama.cpp baseline is skipped). A llama-bench binary first, else an
    installed llama-cpp-python."""
    binary = find_llama_bench(explicit)
    if binary is None and not llama_cpp_installed():
        return None, (
            "llama.cpp baseline skipped: no llama-bench binary (pass --llamacpp-bench PATH or set "
            "MEDUSA_CHAT_LLAMA_BENCH; build it from llama.cpp or the llama-cpp-python sdist) and no "
            "llama-cpp-python installed"
        )
    gguf = model_gguf(loaded)
    if gguf is None:
        return None, "llama.cpp baseline skipped: this model was not loaded from a GGUF"
    if binary is None:
        return LlamaCppPython(gguf, threads), ""
    return LlamaBench(binary, gguf, threads), ""
