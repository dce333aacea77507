"""`bench --baselines llamacpp-spec`: llama.cpp's own speculative modes as peers, through its OpenAI API.

`llama-server` (llama.cpp's; built from llama.cpp or the llama-cpp-python sdist, docs/benchmarks.md; an optional
tool, never a dependency) is started on the same GGUF and thread count as the bench, once per mode:

    llamacpp-server   plain decoding (no flags)
    llamacpp-ngram    `--spec-type ngram-mod` (drafts from n-grams of the context, no draft model)
    llamacpp-eagle3   `-md DRAFT --spec-type draft-eagle3`, DRAFT the model's EAGLE-3 draft written by
                      export-draft (export/llamacpp.py) into a temporary GGUF

and `medusa-chat serve` (this code, the same model options as the bench, no other flags) beside them, so that
every column goes through the same client and timing (bench/api_client.py). The servers are started one after
another and then stopped (SIGSTOP) while anything else runs, so only one of them holds the CPU at a time (an idle
server's polling threads would otherwise slow the method beside it); each prompt goes to each of them in an
order that rotates from prompt to prompt, in the bench's own rotation: side by side on a machine whose speed
drifts. Every request carries the bench's repetition settings (DRY, repeat, presence and frequency penalties) in
llama-server's names, which `medusa-chat serve` shares, so every server answers under the same settings as the
in-process columns. Recorded per server: decode tok/s, llama-server's draft acceptance (`timings.draft_n` /
`draft_n_accepted`: tokens per step = tokens / (tokens - accepted)), whether each reply's text equals llama.cpp's
plain reply (llama.cpp's speculative modes: lossless against their own plain decode) and, for `medusa-chat
serve`, whether it equals the bench's own plain loop (lossless against this engine's plain decode; its numeric
path is not llama.cpp's, so its replies part from llama.cpp's at the first near-tie).

Where to find the binary: `--llama-server PATH`, else $MEDUSA_CHAT_LLAMA_SERVER, else `llama-server` beside the
llama-bench the llamacpp baseline uses, else on PATH. Without one (or without a GGUF) the baseline is skipped
with a note saying why; a mode that cannot run (no EAGLE-3 draft for this model) is skipped alone.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from medusa_chat import envvars
from medusa_chat.bench.api_client import Reply, ServerProcess, acceptance, free_port, stream_chat
from medusa_chat.errors import MedusaChatError

LLAMA_MODES = {"llamacpp-server": [], "llamacpp-ngram": ["--spec-type", "ngram-mod"], "llamacpp-eagle3": []}
SERVE = "medusa-serve"
REFERENCE = "llamacpp-server"  # the replies the others are compared with
CONTEXT = 4096


def find_llama_server(explicit: str | None = None, llama_bench: str | None = None) -> Path | None:
    beside = None
    bench = llama_bench or envvars.value("MEDUSA_CHAT_LLAMA_BENCH") or shutil.which("llama-bench")
    if bench:
        beside = str(Path(bench).with_name("llama-server"))
    for candidate in (
        explicit,
        envvars.value("MEDUSA_CHAT_LLAMA_SERVER"),
        beside,
        shutil.which("llama-server"),
    ):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def llama_server_argv(
    binary: Path, gguf: Path, threads: int, port: int, mode: str, draft: Path | None
) -> list[str]:
    argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(CONTEXT),
            "-np", "1", "--host", "127.0.0.1", "--port", str(port), *LLAMA_MODES[mode]]  # fmt: skip
    if mode == "llamacpp-eagle3":
        assert draft is not None
        argv += ["-md", str(draft), "--spec-type", "draft-eagle3"]
    return argv


@dataclass
class ServerTally:
    replies: list[Reply] = field(default_factory=list)
    same: list[bool] = field(default_factory=list)  # text equal to llama.cpp's plain reply
    same_as_plain_loop: list[bool] = field(default_factory=list)  # text equal to the bench's plain loop's

    def tokens_per_s(self) -> float | None:
        """Total decode tokens over total decode time (the bench's harmonic total)."""
        tokens = sum(r.tokens - 1 for r in self.replies if r.tokens > 1)
        seconds = sum(r.decode_s for r in self.replies if r.tokens > 1)
        return tokens / seconds if seconds > 0 else None

    def drafting(self) -> dict[str, Any] | None:
        drafted = accepted = made = 0
        for r in self.replies:
            d, a = acceptance(r.timings)
            drafted, accepted, made = drafted + d, accepted + a, made + int(r.timings.get("predicted_n") or 0)
        if not drafted:
            return None
        steps = made - accepted
        return {
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4),
            "tokens_per_step": round(made / steps, 4) if steps > 0 else None,
        }


class ServerPeers:
    """The servers of one bench run: started one by one and kept stopped but while one answers a prompt."""

    def __init__(
        self,
        servers: dict[str, ServerProcess],
        notes: list[str],
        workdir: tempfile.TemporaryDirectory[str],
        options: dict[str, Any] | None = None,
    ):
        """`options`: request fields every server gets with every prompt (request_options)."""
        self.servers, self.notes, self._workdir = servers, notes, workdir
        self.options = options or {}
        self.tally = {m: ServerTally() for m in servers}
        self.rows: list[dict[str, Any]] = []
        self._current: dict[str, Reply] = {}

    @property
    def methods(self) -> list[str]:
        return list(self.servers)

    def run(self, method: str, prompt: str, max_tokens: int) -> None:
        """One prompt to one server; a failure drops that server from the rest of the run with a note."""
        server = self.servers.get(method)
        if server is None:
            return
        try:
            server.resume()
            try:
                self._current[method] = stream_chat(server.url, prompt, max_tokens, server.model, self.options)
            finally:
                server.pause()
        except MedusaChatError as err:
            self.notes.append(f"{method} failed: {err}; {server.log_tail()}")
            server.close()
            del self.servers[method]

    def warm(self, prompt: str, max_tokens: int) -> None:
        """An untimed reply from every server (first requests pay one-off costs, as the bench's warm-up says)."""
        for method in list(self.servers):
            self.run(method, prompt, max_tokens)
        self._current = {}

    def end_prompt(self, plain_loop_text: str | None = None) -> dict[str, Any]:
        """Tally the prompt's replies; the row the bench's JSON keeps for it. `plain_loop_text`: the bench's own
        plain loop's reply to the prompt, which `medusa-chat serve`'s must equal."""
        ref = self._current.get(REFERENCE)
        row: dict[str, Any] = {}
        for method, reply in self._current.items():
            t = self.tally[method]
            t.replies.append(reply)
            same = ref is not None and reply.text == ref.text
            if ref is not None:
                t.same.append(same)
            d, a = acceptance(reply.timings)
            row[method] = {
                "tokens": reply.tokens,
                "tokens_per_s": round(reply.tokens_per_s, 3) if reply.tokens_per_s else None,
                "identical_to_llamacpp_plain": same if ref is not None else None,
                **({"draft_tokens": d, "accepted_tokens": a} if d else {}),
            }
            if method == SERVE and plain_loop_text is not None:
                t.same_as_plain_loop.append(reply.text == plain_loop_text)
                row[method]["identical_to_plain_loop"] = t.same_as_plain_loop[-1]
        self._current = {}
        return row

    def summary(self, medusa_tokens_per_s: float | None) -> dict[str, Any]:
        """`llamacpp_*_tokens_per_s` per llama.cpp mode, `medusa_serve_tokens_per_s`, the speedups over the best
        llama.cpp mode, and per server its acceptance and agreement with llama.cpp's plain replies."""
        out: dict[str, Any] = {"llamacpp_spec_notes": self.notes or None}
        rates = {m: t.tokens_per_s() for m, t in self.tally.items()}
        for m, rate in rates.items():
            out[f"{m.replace('-', '_')}_tokens_per_s"] = round(rate, 3) if rate else None
        llama = [r for m, r in rates.items() if m.startswith("llamacpp") and r]
        best = max(llama) if llama else None
        serve = rates.get(SERVE)
        out["medusa_serve_speedup_vs_best_llamacpp"] = round(serve / best, 4) if serve and best else None
        out["speedup_vs_best_llamacpp_mode"] = (
            round(medusa_tokens_per_s / best, 4) if medusa_tokens_per_s and best else None
        )
        out["llamacpp_spec"] = {
            m: {
                "tokens_per_s": round(rates[m], 3) if rates[m] else None,
                "vs_llamacpp_plain": round(rates[m] / rates[REFERENCE], 4)
                if rates[m] and rates.get(REFERENCE)
                else None,
                "identical_to_llamacpp_plain_fraction": _fraction(t.same),
                **({"identical_to_plain_loop_fraction": _fraction(t.same_as_plain_loop)} if m == SERVE else {}),
                "median_tokens_per_s": round(statistics.median(v), 3)
                if (v := [r.tokens_per_s for r in t.replies if r.tokens_per_s])
                else None,
                "drafting": t.drafting(),
            }
            for m, t in self.tally.items()
        }
        return out

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self._workdir.cleanup()


def _fraction(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 4) if flags else None


def request_options(settings: Any) -> dict[str, Any]:
    """The reply's repetition settings (a GenerationSettings) as request fields in llama-server's names, which
    `medusa-chat serve` reads too: every server then penalises as the in-process columns do (llama-server's own
    defaults: no DRY, no repeat penalty; the app's replies: DRY on)."""
    from medusa_chat.engine.penalties import PenaltyOptions

    options = asdict(PenaltyOptions.of(settings))
    options["dry_sequence_breakers"] = list(options["dry_sequence_breakers"])
    return options


def eagle3_draft_gguf(loaded: Any, out: Path) -> Path | None:
    """The model's EAGLE-3 draft as llama.cpp's GGUF (export-draft's writer), or None where it has none: the loaded
    draft when it is EAGLE-3, else the embedded model's shipped one."""
    from medusa_chat.export.llamacpp import write_gguf
    from medusa_chat.export.source import read_draft, resolve_target

    heads = getattr(loaded, "heads", None)
    spec = loaded.spec
    if getattr(heads, "format", "") == "eagle3" and getattr(loaded, "heads_file", ""):
        folder = str(Path(loaded.heads_file).parent)
    elif spec.kind == "embedded" or (spec.kind == "gguf" and _is_embedded_file(Path(spec.backbone))):
        from medusa_chat.model.sources.registry import heads_location

        folder = heads_location("eagle3")
    else:
        return None
    return write_gguf(read_draft(folder), resolve_target(spec), out)


def _is_embedded_file(gguf: Path) -> bool:
    """The embedded model's own GGUF named by path: its shipped EAGLE-3 draft fits it."""
    from medusa_chat.model.sources.embedded import gguf_path

    shipped = gguf_path()
    return shipped is not None and shipped.resolve() == gguf.resolve()


def serve_argv(serve_args: list[str], threads: int, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "medusa_chat",
        "serve",
        *serve_args,
        "--threads",
        str(threads),
        "--port",
        str(port),
    ]


def start_server_peers(
    loaded: Any,
    threads: int,
    serve_args: list[str] | None,
    binaries: tuple[str | None, str | None],
    options: dict[str, Any] | None = None,
) -> tuple[ServerPeers | None, str]:
    """(the started servers, "") or (None, why the baseline is skipped). `binaries`: llama-server's path as
    given (or None) and llama-bench's (llama-server is looked for beside it); `options`: request_options."""
    explicit, llama_bench = binaries
    from medusa_chat.bench.peer import model_gguf

    binary = find_llama_server(explicit, llama_bench)
    if binary is None:
        return None, (
            "llamacpp-spec skipped: no llama-server binary (pass --llama-server PATH or set MEDUSA_CHAT_LLAMA_SERVER; "
            "docs/benchmarks.md says how to build it from the llama-cpp-python sdist)"
        )
    gguf = model_gguf(loaded)
    if gguf is None:
        return None, "llamacpp-spec skipped: this model was not loaded from a GGUF"
    workdir = tempfile.TemporaryDirectory(prefix="medusa-bench-servers-")
    tmp = Path(workdir.name)
    notes: list[str] = []
    draft = eagle3_draft_gguf(loaded, tmp / "draft-eagle3.gguf")
    servers: dict[str, ServerProcess] = {}
    for mode in LLAMA_MODES:
        if mode == "llamacpp-eagle3" and draft is None:
            notes.append("llamacpp-eagle3 skipped: this model has no EAGLE-3 draft to export")
            continue
        port = free_port()
        servers[mode] = ServerProcess(
            mode, llama_server_argv(binary, gguf, threads, port, mode, draft), port, tmp / f"{mode}.log"
        )
    if serve_args is not None:
        port = free_port()
        servers[SERVE] = ServerProcess(SERVE, serve_argv(serve_args, threads, port), port, tmp / "serve.log")
    peers = ServerPeers({}, notes, workdir, options)
    for name, server in servers.items():
        try:
            peers.servers[name] = server.start()
            server.pause()  # before the next one starts: a server that loads or calibrates has the CPU alone
        except MedusaChatError as err:
            notes.append(f"{name} did not start: {err}")
        peers.tally = {m: ServerTally() for m in peers.servers}
    return peers, ""
