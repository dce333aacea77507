"""One thread runs the model's work in a process that serves it (the session: loading and every reply step),
whichever thread asks for it.

Why: the C kernels' parallel regions (OpenMP) give every calling thread a team of worker threads of its own. A
model loaded in one thread and answering in others leaves several teams, more threads than cores, and GNU
OpenMP then stops spinning between regions, so each of a step's hundreds of regions waits for its workers to
wake. Measured on a 2-vCPU Xeon (benchmarks/RESULTS.md, 2026-12-07): the embedded model decoded at about half
its speed in a thread other than the one that loaded it, while loading and decoding in the same (any) thread
ran at full speed. The web page, the API server and the REPL's decode-ahead each read replies from threads of
their own; they now hand every step to this one thread. The first-start calibration keeps a thread of its own (a
reply must be able to start and cancel it meanwhile); its team ends with it.

The bench and the calibrate command run the engine in their own thread from start to end and need none of this.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
THREAD_NAME = "medusa-chat-compute"

_executor: ThreadPoolExecutor | None = None
_guard = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _guard:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        return _executor


def on_compute_thread() -> bool:
    return threading.current_thread().name.startswith(THREAD_NAME)


def submit(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """Run `fn` on the compute thread after what is queued there, with the caller's torch thread count (OpenMP
    keeps that count per thread: `--threads` set in the main thread must hold where the model runs); its Future."""
    import torch

    threads = torch.get_num_threads()

    def call() -> T:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return fn(*args, **kwargs)

    return _pool().submit(call)


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the compute thread (at once when already on it), waited for: its result, or its
    exception raised here."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return submit(fn, *args, **kwargs).result()


__all__ = ["THREAD_NAME", "on_compute_thread", "run", "submit"]
