"""Chat servers as the bench drives them: a server process started and stopped (llama.cpp's `llama-server`,
`medusa-chat serve`), and one streamed OpenAI chat completion timed the way the bench times every method.

Timing (the same for every server): the request is streamed (`stream: true`); the reply's decode time runs from
the first chunk that carries text to the last one, and its rate counts the tokens after the first (the server's
`usage.completion_tokens`, else llama-server's `timings.predicted_n`, minus one): prefill and first token excluded,
as bench/runs.py's TIMING_NOTE says for the in-process methods. Standard library only (urllib): the client adds
nothing of its own to either server's side of the comparison.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from medusa_chat.errors import MedusaChatError


@dataclass
class Reply:
    """One streamed reply and its timing."""

    text: str
    tokens: int  # completion tokens
    ttft_s: float  # request sent -> first text chunk
    decode_s: float  # first text chunk -> last text chunk
    timings: dict[str, Any] = field(default_factory=dict)  # llama-server's own `timings`, where it sends them

    @property
    def tokens_per_s(self) -> float | None:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else None


def sse_payload(line: bytes) -> dict[str, Any] | None:
    """The JSON of one server-sent-events `data:` line; None for other lines and for `data: [DONE]`."""
    text = line.decode("utf-8", "replace").strip()
    if not text.startswith("data:"):
        return None
    body = text[5:].strip()
    if not body or body == "[DONE]":
        return None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        raise MedusaChatError(f"the server streamed a line that is not JSON: {body[:120]!r}") from err
    return obj if isinstance(obj, dict) else None


def reply_from_events(events: list[tuple[float, dict[str, Any]]], t_sent: float) -> Reply:
    """A Reply from the streamed chunks, each with the time it arrived."""
    text, stamps, usage, timings = [], [], None, {}
    for t, chunk in events:
        if "error" in chunk:
            raise MedusaChatError(f"the server answered an error: {json.dumps(chunk['error'])[:200]}")
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
                stamps.append(t)
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
    tokens = int((usage or {}).get("completion_tokens") or timings.get("predicted_n") or 0)
    if not stamps:
        return Reply("", tokens, 0.0, 0.0, timings)
    return Reply("".join(text), tokens, stamps[0] - t_sent, stamps[-1] - stamps[0], timings)


def served_model(base_url: str) -> str:
    """The first model id GET /v1/models lists (`medusa-chat serve` refuses any other; llama-server takes any)."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as r:
            models = json.loads(r.read()).get("data") or []
    except (urllib.error.URLError, OSError, json.JSONDecodeError, AttributeError):
        return "default"
    return str(models[0].get("id") or "default") if models and isinstance(models[0], dict) else "default"


def stream_chat(
    base_url: str,
    prompt: str,
    max_tokens: int,
    model: str = "default",
    options: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
) -> Reply:
    """POST one greedy chat completion to `base_url`/v1/chat/completions, streamed, and time it. `options`: more
    request fields, the same for every server (the bench's repetition settings, in llama-server's names)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(options or {}),
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
    )
    events: list[tuple[float, dict[str, Any]]] = []
    t_sent = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            for line in response:
                payload = sse_payload(line)
                if payload is not None:
                    events.append((time.perf_counter(), payload))
    except urllib.error.HTTPError as err:
        detail = err.read().decode("utf-8", "replace")[:200]
        raise MedusaChatError(f"{base_url} answered HTTP {err.code}: {detail}") from err
    except (urllib.error.URLError, OSError) as err:
        raise MedusaChatError(f"{base_url} did not answer: {err}") from err
    return reply_from_events(events, t_sent)


def acceptance(timings: dict[str, Any]) -> tuple[int, int]:
    """(draft tokens proposed, draft tokens accepted) from llama-server's `timings` (0, 0 without drafting)."""
    return int(timings.get("draft_n") or 0), int(timings.get("draft_n_accepted") or 0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server started as a child process on 127.0.0.1:`port`, ready once GET /health answers 200 (llama-server
    says 503 while it loads; `medusa-chat serve` binds before it loads and reports `loaded`)."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, env: dict[str, str] | None = None):
        self.name, self.argv, self.port, self.log = name, argv, port, log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.model = "default"  # the id the server lists, read once it is ready
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        self._log = self.log.open("wb")
        env = {**os.environ, **(self.env or {})}
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MedusaChatError(
                    f"{self.name} exited ({self.proc.returncode}) while starting: {self.log_tail()}"
                )
            if self._healthy():
                self.model = served_model(self.url)
                return self
            time.sleep(0.25)
        self.close()
        raise MedusaChatError(f"{self.name} was not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                body = json.loads(r.read() or b"{}")
                return r.status == 200 and body.get("loaded", True) is not False
        except (urllib.error.URLError, OSError, json.JSONDecodeError):
            return False

    def log_tail(self, lines: int = 3) -> str:
        try:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            tail = []
        return " | ".join(tail)[-400:] or "no output"

    def pause(self) -> None:
        """Stop the process (SIGSTOP) while the other methods run: an idle server's threads still poll for work
        for a while after each request (llama.cpp's `--poll`, OpenMP's spin wait), and on a small machine
        that spinning slows whichever method runs next, and makes a tree sizer price its steps under load."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            # Wait until it has stopped (signals are asynchronous), so the next method starts on a quiet CPU. A
            # child that exits instead is reaped here: keep its status where Popen looks for it.
            _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
            if not os.WIFSTOPPED(status):
                self.proc.returncode = os.waitstatus_to_exitcode(status)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()  # a stopped process acts on SIGTERM only once continued
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
