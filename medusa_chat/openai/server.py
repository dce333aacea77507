"""The OpenAI-compatible HTTP API: `medusa-chat serve`, and the same `/v1` routes inside `medusa-chat web`.

Routes (FastAPI; uvicorn serves them): `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`
(plain JSON or SSE streaming in the official chunk format, ending with `data: [DONE]`). Every reply carries
`usage` and a `medusa` extension object (tokens per step, steps, decode tokens/s, acceptance mode, tree).

The API is stateless: each request brings its messages, and `SessionManager.complete` answers them under the
session's exclusive lock without touching the UI's conversation. One reply decodes at a time; API requests
wait their turn in FIFO order in a bounded queue (full: 503). A client that disconnects (while waiting or
while its reply streams) sets its reply's stop flag, which the engine checks every step. Every bad request
gets an OpenAI-style error object (`{"error": {"message", "type", "param", "code"}}`) with a 4xx status;
unexpected failures are logged here and answered with a 500 that holds no traceback.

This module holds no model logic: prompts, settings and decoding all belong to the session and the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from medusa_chat import envvars
from medusa_chat.errors import MedusaChatError
from medusa_chat.openai.protocol import API_KEY_ENV, install_error_handlers
from medusa_chat.openai.routes import DEFAULT_MAX_QUEUE, mount_api

if TYPE_CHECKING:
    import uvicorn

    from medusa_chat.chat.session import SessionManager

log = logging.getLogger("medusa_chat.openai.server")

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_PORT = 8000


# ---- mounting and serving -------------------------------------------------------------------------------------
def create_app(
    session: SessionManager, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE
) -> FastAPI:
    """The standalone server's application (`medusa-chat serve`): the API at `/v1`, and `/health`."""
    root = FastAPI(title="medusa-chat", docs_url=None, redoc_url=None, openapi_url=None)
    sub = mount_api(root, session, api_key=api_key, max_queue=max_queue)

    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": sub.state.chat_api.model_id, "loaded": session.is_loaded}

    root.add_api_route("/health", health, methods=["GET"])
    install_error_handlers(root)
    root.state.chat_api = sub.state.chat_api
    return root


def host_warning(host: str, api_key: str | None, what: str = "the API") -> str | None:
    """The warning printed when a server (`what`: the API, or the web chat with the API) listens on anything but
    this machine's loopback address; None on loopback."""
    if host in LOCAL_HOSTS:
        return None
    guard = (
        "requests need the API key" if api_key else f"there is no API key (set --api-key or {API_KEY_ENV})"
    )
    return (
        f"warning: serving {what} on {host}: anyone who can reach this machine at that address can use your "
        f"model; {guard}. Leave out --host to keep it on 127.0.0.1."
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: a free one), so a taken port is a clear error here
    instead of uvicorn exiting the process."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, socket.gaierror) as err:
        raise MedusaChatError(f"cannot listen on {host}:{port}: {err}") from err
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise MedusaChatError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    return sock


class APIServer:
    """uvicorn serving an app on a bound socket; `start()` runs it in a background thread (tests), `run()`
    in this one until Ctrl-C."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = DEFAULT_PORT, log_level: str = "info"):
        import uvicorn

        self.app = app
        self.sock = bind_socket(host, port)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(
            app,
            log_level=log_level,
            access_log=log_level in ("info", "debug"),
            timeout_graceful_shutdown=3,  # open streams get their stop flag; do not hang Ctrl-C on them
        )
        self.server: uvicorn.Server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, timeout: float = 30.0) -> APIServer:
        self._thread = threading.Thread(target=self.run, name="medusa-chat-api-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise MedusaChatError(f"the API server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self.sock.close()


# ---- CLI ------------------------------------------------------------------------------------------------------
def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    """--api-key (also used by `medusa-chat web`, whose app serves the same routes)."""
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1 requests (default: ${API_KEY_ENV}, else none)",
    )


def resolve_api_key(args: argparse.Namespace) -> str | None:
    return getattr(args, "api_key", None) or envvars.value(API_KEY_ENV) or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `medusa-chat serve` (on top of the model options)."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; anything else is reachable by others)",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    add_api_key_argument(parser)
    from medusa_chat.cliargs import add_generation_args

    add_generation_args(parser, "serve")  # --accept: the rule for requests with temperature > 0
    parser.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        metavar="N",
        help=f"requests that may wait while one decodes; more get 503 (default {DEFAULT_MAX_QUEUE})",
    )


def serve_main(args: argparse.Namespace) -> int:
    """`medusa-chat serve`: load the model, then serve the OpenAI-compatible API until Ctrl-C."""
    from medusa_chat.chat.session import SessionManager

    api_key = resolve_api_key(args)
    host = getattr(args, "host", None) or "127.0.0.1"
    max_queue = int(getattr(args, "max_queue", DEFAULT_MAX_QUEUE))
    if max_queue < 0:
        raise MedusaChatError(f"--max-queue must be >= 0 (got {max_queue})")
    warning = host_warning(host, api_key)
    if warning:
        print(warning, file=sys.stderr)
    session = SessionManager.from_args(args)
    from medusa_chat.cliargs import given_settings

    session.update_settings(**given_settings(args))  # --accept; a request sets the rest
    # Bind first: a taken port is reported before minutes of model loading, not after.
    server = APIServer(create_app(session, api_key=api_key, max_queue=max_queue), host, args.port)
    session.load(progress=lambda text: print(text, file=sys.stderr, flush=True))
    for notice in session.notices:
        print(notice, file=sys.stderr)
    info = session.info
    print(
        f"medusa-chat API: {server.url}/v1  model {info.get('model')!r}, tree {info.get('tree')} "
        f"({info.get('tree_size')} nodes){', API key required' if api_key else ''}  (Ctrl-C stops it)",
        flush=True,
    )
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(OSError):
            server.sock.close()
    return 0
