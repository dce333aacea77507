"""How many threads the native CPU step uses, adapted to a machine that other processes also keep busy.

Why: the native step (kernels/csrc/decoder.c) is one OpenMP region per step with a barrier after every
worksharing loop. When another process holds one of the cores, each barrier waits for whichever of our threads
is descheduled: on 2 cores with one busy, a ~5 ms step was measured at ~2400 ms. One thread has no barrier to
wait on, so under such load it is far faster; on a quiet machine all cores are faster. The count never changes
an output bit (the kernels split work by rows, column groups, heads and key ranges, never inside one sum:
tests/test_threads.py), so it can change between any two steps.

The rule (ThreadGovernor.observe, fed each decoding step's wall time and tree size):
- on all threads: a step time is compared with the median of recent quiet steps of the same tree size; when the
  last WINDOW steps' median runs more than SLOW times that (or one step STALL times), the step drops to the busy
  mode. Rarely (every `down_every` steps, doubling after each probe that lost) it also tries the busy mode for
  PROBE steps, which catches a load that was already there when the quiet median formed.
- in the busy mode: every PROBE_EVERY steps (DUET_PROBE times that with the duet; doubling after each lost try)
  it tries all threads for PROBE steps
  and keeps them when they were clearly (WIN) faster than the busy mode's steps of the same sizes.
The busy mode is the duet (kernels/csrc/duet.c): the step on one thread, its block products and attention shared
with a helper thread that runs only on otherwise idle time (SCHED_IDLE) and is never waited for. Under a process that keeps a
core busy it is the one-thread step (the helper gets no time); where the load comes and goes (a browser drawing
the reply) the helper takes the idle slices. MEDUSA_CHAT_DUET=0 makes the busy mode plain one thread.
A fixed count (`--threads N`, or MEDUSA_CHAT_THREADS) turns this off; torch's own pool follows it too.
"""

from __future__ import annotations

import statistics
from collections import deque

from medusa_chat import envvars
from medusa_chat.errors import SettingError

WINDOW = 8  # recent steps judged together (a median: one hiccup is not load)
SLOW = 2.0  # "much slower than quiet"
STALL = 10.0  # one step this much slower than quiet: a barrier waited on a descheduled thread, drop at once
PROBE_EVERY = 32  # steps on 1 thread between two tries of all threads (doubles after each lost try, up to
PROBE_MAX = 256  # PROBE_MAX: under lasting load every try costs PROBE slow steps)
WIN = 0.8  # a try wins when its steps' median is below this fraction of the other count's (noise is not a win)
PROBE = 4  # steps per try
# With the duet as the busy mode the tries of all threads are this many times rarer: staying in the duet when the
# load has gone costs ~10% of a step (one thread: ~55%), while a try under load stalls. Measured with the web
# page against `ask` (benchmarks/browser_vs_ask.py, alternating runs): 0.78x / 0.84x against 0.78x / 0.75x.
DUET_PROBE = 4
DOWN_EVERY = 64  # steps on all threads before a try of 1 thread (doubles after each lost try, up to DOWN_MAX)
DOWN_MAX = 1024
HISTORY = 32  # step times kept per (threads, tree size)

_fixed: tuple[int, str] | None = None  # (count, who fixed it) once `fix` was called


def fix(n: int, source: str = "--threads") -> None:
    """A fixed thread count for this process (the CLI's --threads): our kernels and torch's pool both use it."""
    global _fixed
    if n < 1:
        raise ValueError(f"--threads must be at least 1 (got {n})")
    _fixed = (n, source)
    _apply_fixed()


def fixed() -> tuple[int, str] | None:
    """(count, source) when the thread count is fixed (`fix`, else MEDUSA_CHAT_THREADS), else None."""
    if _fixed is not None:
        return _fixed
    env = envvars.value("MEDUSA_CHAT_THREADS") or ""
    if env:
        try:
            n = int(env)
        except ValueError as err:
            raise SettingError(f"MEDUSA_CHAT_THREADS must be a positive integer (got {env!r})") from err
        if n >= 1:
            return n, "MEDUSA_CHAT_THREADS"
    return None


def _apply_fixed() -> None:
    f = fixed()
    if f is None:
        return
    import torch

    from medusa_chat.kernels import cbind, cthreads

    torch.set_num_threads(f[0])
    if cbind.available():
        cthreads.set_threads(f[0])


def describe() -> str:
    """What runs, for `info`: "2, adaptive" or "1, fixed by MEDUSA_CHAT_THREADS"."""
    f = fixed()
    if f is not None:
        return f"{f[0]}, fixed by {f[1]}"
    busy = "1 + an idle-time helper" if busy_mode() != 1 else "1"
    return f"{_full_threads()}, adaptive ({busy} while other processes keep the cores busy)"


def adapts(runner) -> bool:
    """Does a ThreadGovernor change the thread count for this BackboneRunner? Only the native C step's (the
    kernels' count, not torch's), and only while no count is fixed and the machine has more than one core."""
    from medusa_chat.model.forward.block_forward import NativeForward

    return fixed() is None and isinstance(runner.lean, NativeForward) and _full_threads() > 1


def busy_mode() -> int:
    """The count the governor sets on a busy machine: cthreads.DUET where the duet runtime runs (and
    MEDUSA_CHAT_DUET is not 0), else 1."""
    from medusa_chat.kernels import cthreads

    if not envvars.enabled("MEDUSA_CHAT_DUET") or not cthreads.duet_available():
        return 1
    return cthreads.DUET


def _full_threads() -> int:
    from medusa_chat.kernels import cthreads

    cthreads.set_threads(0)  # the runtime's default team (OMP_NUM_THREADS, torch's setting, the cores)
    return max(1, cthreads.get_threads())


class ThreadGovernor:
    """Picks the native step's thread count from step times (module docstring). `observe` after each step;
    `threads` is the count in use. `set_threads` (the kernel's setter) is injectable for tests."""

    def __init__(self, full: int | None = None, set_threads=None) -> None:
        from medusa_chat.kernels import cthreads

        self._set = set_threads or cthreads.set_threads
        f = fixed()
        self.adaptive = f is None
        self.full = f[0] if f is not None else (full or _full_threads())
        self.adaptive = self.adaptive and self.full > 1
        self.threads = self.full
        self.busy = busy_mode() if self.adaptive else 1
        self._times: dict[tuple[int, int], deque[float]] = {}
        self._recent: deque[float] = deque(maxlen=WINDOW)  # last steps' time / quiet median, on all threads
        self._probe: list[float] = []  # a try's ratios to the other count's medians
        self._probing = False
        self._since = 0  # steps since the last switch or try
        self._down_every = DOWN_EVERY
        self.probe_every = PROBE_EVERY * (DUET_PROBE if self.busy != 1 else 1)  # busy mode: steps between tries
        self._up_every = self.probe_every
        self.fixed = f is not None
        self.resume()

    def resume(self) -> None:
        """Put this governor's count in force (the count is process-wide: another engine may have set its own
        since; generate calls this first)."""
        self._set(self.threads)
        if self.fixed:
            import torch

            torch.set_num_threads(self.threads)

    def _median(self, threads: int, size: int) -> float | None:
        times = self._times.get((threads, size))
        return statistics.median(times) if times and len(times) >= 3 else None

    def _record(self, threads: int, size: int, seconds: float) -> None:
        self._times.setdefault((threads, size), deque(maxlen=HISTORY)).append(seconds)

    def _use(self, n: int) -> None:
        if n != self.threads:
            self.threads = n
            self._set(n)
        self._since = 0
        self._recent.clear()

    def observe(self, seconds: float, size: int) -> None:
        """One decoding step took `seconds` on a tree of `size` nodes."""
        if not self.adaptive:
            return
        self._since += 1
        other = self.busy if self.threads == self.full else self.full
        if self._probing:
            base = self._median(other, size)
            if base:
                self._probe.append(seconds / base)
            if self.threads == self.busy or (base and seconds / base < 1.0):  # no slow step into the quiet median
                self._record(self.threads, size, seconds)
            stalled = bool(self._probe) and self._probe[-1] > STALL  # no need to sit through more of those
            if stalled or len(self._probe) >= PROBE or self._since >= 2 * PROBE:
                won = not stalled and bool(self._probe) and statistics.median(self._probe) < WIN
                self._probing = False
                if self.threads == self.busy:  # a try of the busy mode from all threads
                    self._down_every = DOWN_EVERY if won else min(2 * self._down_every, DOWN_MAX)
                else:
                    scale = self.probe_every // PROBE_EVERY
                    self._up_every = self.probe_every if won else min(2 * self._up_every, PROBE_MAX * scale)
                self._use(self.threads if won else other)
            return
        if self.threads == self.full:
            quiet = self._median(self.full, size)
            ratio = seconds / quiet if quiet else 1.0
            self._recent.append(ratio)
            if ratio <= SLOW:  # only quiet steps make the quiet median: load must not raise it
                self._record(self.full, size, seconds)
            if ratio > STALL or (len(self._recent) == WINDOW and statistics.median(self._recent) > SLOW):
                self._use(self.busy)
            elif self._since >= self._down_every:
                self._try(self.busy)
        else:
            self._record(self.busy, size, seconds)
            if self._since >= self._up_every:
                self._try(self.full)

    def _try(self, n: int) -> None:
        self._use(n)
        self._probing = True
        self._probe = []


def threads_line(gov: ThreadGovernor | None, steps: int, busy_steps: int) -> str:
    """What ran a reply's steps on a CPU: e.g. "2 threads; 79 of 85 steps in the busy mode (1 + an idle-time
    helper)"; "" off the native CPU step (no governor)."""
    if gov is None:
        return ""
    if not gov.adaptive:
        return f"{gov.threads} thread{'s' * (gov.threads != 1)} (fixed)"
    busy = "1 + an idle-time helper" if gov.busy != 1 else "1 thread"
    return f"{gov.full} threads; {busy_steps} of {steps} steps in the busy mode ({busy})"
