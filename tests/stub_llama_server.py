"""A stand-in for llama.cpp's `llama-server` where none is built (CI): a real HTTP server process that takes the
same command line (`-m`, `--port`, `--spec-type`, `-md`, ...), answers GET /health with 503 for its first
requests (llama-server says 503 while it loads) and then 200, and streams a chat completion as llama-server's
OpenAI endpoint does: one SSE chunk per token, a last chunk with `timings` (draft_n / draft_n_accepted when a
speculative mode is on) and `usage`, then `data: [DONE]`. The reply is a fixed function of the prompt and of whether the request turns DRY on."""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"health_calls": 0, "spec": None}


def reply_words(prompt: str, max_tokens: int) -> list[str]:
    words = [f"w{len(prompt) % 7}", *[f" t{i}" for i in range(1, 64)]]
    return words[: max(1, max_tokens)]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "stub.gguf", "object": "model"}]})
            return
        if self.path != "/health":
            self.send_error(404)
            return
        STATE["health_calls"] += 1
        ready = STATE["health_calls"] > 2
        self._json(200 if ready else 503, {"status": "ok"} if ready else {"error": {"message": "Loading model"}})

    def _json(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        request = json.loads(self.rfile.read(length))
        if request.get("model") != "stub.gguf":  # as `medusa-chat serve` does: the listed id only
            self._json(404, {"error": {"message": f"model {request.get('model')!r} does not exist"}})
            return
        words = reply_words(request["messages"][-1]["content"], int(request.get("max_tokens") or 16))
        if request.get("dry_multiplier"):  # a penalty changes the reply, as llama-server's DRY would
            words[0] += "dry"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for w in words:
            self._event({"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]})
        timings = {"predicted_n": len(words), "predicted_ms": 1.0}
        if STATE["spec"]:
            timings.update(draft_n=len(words), draft_n_accepted=len(words) // 2)
        self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "timings": timings})
        self._event({"choices": [], "usage": {"completion_tokens": len(words), "prompt_tokens": 5}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--spec-type", default=None)
    p.add_argument("-md", default=None)
    args, _ = p.parse_known_args()
    STATE["spec"] = args.spec_type
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
