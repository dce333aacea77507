"""The GPU run of benchmarks/gpu_4bit.py as a plan: which commands run on a GPU machine, what each carries, how
long each stage may take, and which summary keys each yields. `python benchmarks/gpu_4bit.py plan` prints it as
JSON; benchmarks/gpu_checks.sh reads its stage limits from it (`plan --part NAME --stages`), so the limits live
here alone.

Why three commands: the embedded model's GGUF (~98 MB) exceeds what one command carries, so it goes in two
pieces with the first two commands and is joined on the machine (which keeps /tmp between commands while it is
held). What a command carries is the repository's tracked files present in the working tree plus the ignored
paths it names: each command names the tracked paths it needs (`tracked`, git sparse-checkout patterns) and the
drafts, results and data it does not need stay behind (`before`: the sparse-checkout to set; `after` of the
last: back to the whole tree). The most valuable figures come first: the 7B-shaped step (part1), then the
embedded model's drafts with int4 (part2, part3), then the kernels side by side (part3, last). Every stage
writes its JSON into $OUT as it goes, so a timeout loses the stage in flight only.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
SUMMARY_KEYS = (
    "card", "plain_tok_s_7b", "nf4_plain_tok_s_7b", "tree64_step_ratio_7b", "kl_4bit", "kl_nf4",
    "embedded_medusa_speedup", "embedded_identical_fraction",
)  # fmt: skip
GGUF_BYTES = 103_604_096  # the embedded SmolLM2-135M Q4_1 GGUF, when it is not on this machine to measure


@dataclass(frozen=True)
class Limits:
    """What the GPU machine allows (parameters: the plan is checked against whatever is passed)."""

    commands: int = 3
    total_s: int = 540  # command time, all commands together
    command_s: int = 600  # one command
    payload_bytes: int = 60 * MiB  # what one command carries (the repository's files included)
    setup_s: int = 15  # per command: copying pieces, joining, the machine's own start of the command


@dataclass(frozen=True)
class Stage:
    name: str
    limit_s: int
    yields: tuple[str, ...] = ()  # summary keys its JSON holds


@dataclass
class Command:
    name: str
    stages: tuple[Stage, ...]
    tracked: tuple[str, ...]  # sparse-checkout patterns: the tracked files this command needs
    carry: tuple[str, ...] = ()  # ignored paths it carries
    bytes: int = 0
    time_limit_s: int = 0
    command: str = ""
    before: str = ""
    notes: list[str] = field(default_factory=list)


CODE = ("/pyproject.toml", "/medusa_chat/", "/benchmarks/*.py", "/benchmarks/*.sh",
        "/benchmarks/data/vicuna_bench_question.jsonl")  # fmt: skip
HYDRA = ("/assets/smollm2-135m/",)
DRAFTS = (*HYDRA, "/assets/smollm2-135m-eagle3/", "/assets/smollm2-135m-medusa1/")
STEP_KEYS = ("card", "plain_tok_s_7b", "nf4_plain_tok_s_7b", "tree64_step_ratio_7b")
EMBEDDED_KEYS = ("embedded_medusa_speedup", "embedded_identical_fraction")


def commands() -> list[Command]:
    return [
        Command(
            "part1",
            (Stage("step_4bit", 140, STEP_KEYS), Stage("cuda_tests", 40)),
            (*CODE, "/tests/"),
            (".whl/site", ".gpu/p0"),
        ),  # fmt: skip
        Command(
            "part2",
            (Stage("embedded_prepare", 40), Stage("embedded_hydra_int4", 70, EMBEDDED_KEYS)),
            (*CODE, *HYDRA),
            (".gpu/p1",),
        ),  # fmt: skip
        Command(
            "part3",
            (
                Stage("fidelity_4bit", 50, ("kl_4bit", "kl_nf4")),
                Stage("embedded_eagle3_int4", 40),
                Stage("embedded_medusa1_int4", 40),
                Stage("kernels_4bit", 45),
                Stage("summary", 10),
            ),
            (*CODE, *DRAFTS),
        ),  # fmt: skip
    ]


def tracked_files(root: Path = ROOT) -> dict[str, int]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    files = {}
    for name in out.decode().split("\0"):
        if name and (root / name).is_file():
            files[name] = (root / name).stat().st_size
    return files


def matches(name: str, pattern: str) -> bool:
    """A gitignore-style sparse pattern: "/dir/" (a folder), "/dir/*.py" (one level), "/file"."""
    pat = pattern.lstrip("/")
    if pat.endswith("/"):
        return name.startswith(pat)
    return fnmatch.fnmatchcase(name, pat) and name.count("/") == pat.count("/")


def folder_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def gguf_bytes() -> int:
    try:
        import sys

        sys.path.insert(0, str(ROOT))
        from medusa_chat.model.sources.embedded import gguf_path

        path = gguf_path()
        return path.stat().st_size if path is not None else GGUF_BYTES
    except Exception:  # noqa: BLE001 - the plan is printed where the embedded package is absent too
        return GGUF_BYTES


def make_plan(
    limits: Limits, gguf: int | None = None, whl: int | None = None, root: Path = ROOT
) -> dict[str, Any]:
    """The commands with their bytes and time limits; the GGUF split so that each piece fills what its command
    leaves free (`pieces`: bytes of .gpu/p0 and .gpu/p1, for gpu_stage_gguf.sh)."""
    files = tracked_files(root)
    gguf = gguf_bytes() if gguf is None else gguf
    whl = folder_bytes(root / ".whl" / "site") if whl is None else whl
    # the second piece's command: its tracked files, the HF files and hashes beside the piece (~4 MiB)
    cmds = commands()
    own = {c.name: sum(size for name, size in files.items() if any(matches(name, p) for p in c.tracked))
           for c in cmds}  # fmt: skip
    extra_p1 = 4 * MiB
    first = limits.payload_bytes - own["part1"] - whl - MiB  # 1 MiB: untracked files that ride along
    pieces = [min(gguf, max(0, first)), max(0, gguf - max(0, first))]
    sizes = {".whl/site": whl, ".gpu/p0": pieces[0], ".gpu/p1": pieces[1] + extra_p1}
    for c in cmds:
        c.bytes = own[c.name] + sum(sizes.get(p, 0) for p in c.carry)
        c.time_limit_s = sum(s.limit_s for s in c.stages) + limits.setup_s
        c.command = f'bash benchmarks/gpu_checks.sh {c.name} "$OUT"'
        c.before = "git sparse-checkout set --no-cone " + " ".join(f"'{p}'" for p in c.tracked)
    return {
        "limits": asdict(limits),
        "pieces": pieces,
        "prepare_here": ["bash benchmarks/gpu_prepare.sh", f"bash benchmarks/gpu_stage_gguf.sh {pieces[0]} {pieces[1]}"],
        "commands": [asdict(c) for c in cmds],
        "after": "git sparse-checkout disable",
        "total_time_s": sum(c.time_limit_s for c in cmds),
        "summary_keys": sorted({k for c in cmds for s in c.stages for k in s.yields}),
    }  # fmt: skip


def problems(plan: dict[str, Any], limits: Limits) -> list[str]:
    """What in `plan` breaks `limits` (empty: it fits)."""
    out = []
    cmds = plan["commands"]
    if len(cmds) > limits.commands:
        out.append(f"{len(cmds)} commands > {limits.commands}")
    if plan["total_time_s"] > limits.total_s:
        out.append(f"{plan['total_time_s']} s of commands > {limits.total_s} s")
    for c in cmds:
        if c["bytes"] >= limits.payload_bytes:
            out.append(f"{c['name']} carries {c['bytes']} bytes >= {limits.payload_bytes}")
        if c["time_limit_s"] > limits.command_s:
            out.append(f"{c['name']} may take {c['time_limit_s']} s > {limits.command_s} s")
        out += [f"{c['name']}: stage {s['name']} {s['limit_s']} s > its command's {c['time_limit_s']} s"
                for s in c["stages"] if s["limit_s"] > c["time_limit_s"]]  # fmt: skip
    if len([p for p in plan["pieces"] if p]) > 2:
        out.append("the GGUF in more than two pieces")
    if plan["pieces"][0] <= 0:
        out.append("no room for the GGUF's first piece")
    missing = set(SUMMARY_KEYS) - set(plan["summary_keys"])
    if missing:
        out.append(f"summary keys no stage yields: {sorted(missing)}")
    return out


def stage_lines(part: str) -> str:
    """`name limit_s` per stage of one command, for gpu_checks.sh."""
    [c] = [c for c in commands() if c.name == part]
    return "\n".join(f"{s.name} {s.limit_s}" for s in c.stages)


def limits_from_env() -> Limits:
    """GPU_PLAN_<FIELD> overrides (e.g. GPU_PLAN_PAYLOAD_BYTES) for a machine with other limits."""
    base = Limits()
    return Limits(**{k: int(os.environ.get(f"GPU_PLAN_{k.upper()}", v)) for k, v in asdict(base).items()})
