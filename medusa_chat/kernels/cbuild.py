"""The C compiler driver: every `.c` file in csrc/ built into one shared library per instruction set, with
AVX-VNNI / AVX512-VNNI dot products where this CPU has them (which one runs: isa_choice.py; the same bits).

The library is compiled once per instruction set with the system C compiler the first time it is needed (a few
seconds) and kept in the user cache dir under a hash of every source and header, the flags and the instruction
set (`library_file`). Loading it and declaring its functions is cbind.py's job.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

# -ffp-contract=off: no implicit a*b+c -> fma fusion, whose use could differ between a loop's vector body and
# its scalar remainder; every FMA in the kernels is an explicit intrinsic, so each element is computed alike.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# Integer dot-product instructions, used where this CPU has them (qgemm.c: the same exact integer block sums in
# fewer instructions, so results are bitwise the same as the AVX2 build's)
ISA_FLAGS = {
    "avx2": (),
    "avxvnni": ("-mavxvnni",),
    "avx512vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
}
CSRC = "medusa_chat.kernels.csrc"


def sources() -> tuple[list[str], list[str]]:
    """The C sources and headers in csrc/ (sorted): every one is compiled or included, and hashed."""
    names = sorted(f.name for f in resources.files(CSRC).iterdir() if f.is_file())
    return [n for n in names if n.endswith(".c")], [n for n in names if n.endswith(".h")]


def hash_sources(h: Any) -> Any:
    """`h` (a hashlib object) updated with every source and header of csrc/, names and bytes: what a library's
    name, and a choice made by timing libraries (isa_choice.py), depend on."""
    for name in (n for group in sources() for n in group):
        h.update(name.encode())
        h.update(resources.files(CSRC).joinpath(name).read_bytes())
    return h


def compile_all(cc: str, flags: tuple[str, ...], c_files: list[str]) -> str:
    """Compile every `x.c` to `x.o` beside it, up to one process per core at a time; the first failure's
    compiler output, or "" when all compiled."""
    from concurrent.futures import ThreadPoolExecutor

    def one(c_file: str) -> str:
        cmd = [cc, *flags, "-c", c_file, "-o", c_file[:-2] + ".o"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return (done.stderr or f"{cc} exited with {done.returncode}") if done.returncode else ""

    with ThreadPoolExecutor(max_workers=max(1, min(len(c_files), os.cpu_count() or 1))) as pool:
        return next((err for err in pool.map(one, c_files) if err), "")


def build(out: Path, flags: tuple[str, ...]) -> None:
    """Compile and link every source in csrc/ with `flags` into the shared library `out` (written whole or not
    at all); RuntimeError with the compiler's own words when that fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) found")
    with tempfile.TemporaryDirectory() as tmp:
        c_files = []
        c_names, headers = sources()
        for name in headers:
            (Path(tmp) / name).write_text(resources.files(CSRC).joinpath(name).read_text())
        for name in c_names:
            c_file = Path(tmp) / name
            c_file.write_text(resources.files(CSRC).joinpath(name).read_text())
            c_files.append(str(c_file))
        so = Path(tmp) / "qgemm.so"
        # Each source its own compiler process, as many at once as there are cores, then one link: the same
        # objects as one `cc a.c b.c ...`, which compiles them one after another (attention.c and kquants.c
        # alone take most of it). The build is part of the very first start's wait; on busy cores the
        # parallel build gains little (10.3 -> 9.4 s measured at load 4.4 on 2 cores), on idle ones up to
        # the number of cores.
        failed = compile_all(cc, flags, c_files)
        if failed:
            raise RuntimeError(f"compiling the qgemm kernel failed: {failed.strip()[:300]}")
        cmd = [cc, *flags, *(c[:-2] + ".o" for c in c_files), "-o", str(so)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"linking the qgemm kernel failed: {done.stderr.strip()[:300]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy(so, tmp_out)
        os.replace(tmp_out, out)


def library_file(isa: str) -> Path:
    """The cached library for `isa`, built first if this set of sources, flags and instruction set has none
    yet (RuntimeError, OSError or SubprocessError when it cannot be built)."""
    from medusa_chat.paths import cache_root

    flags = (*CFLAGS, *ISA_FLAGS[isa])
    h = hash_sources(hashlib.sha256(" ".join(flags).encode()))
    path = cache_root() / "kernels" / f"qgemm-{isa}-{h.hexdigest()[:16]}.so"
    if not path.is_file():
        build(path, flags)
    return path
