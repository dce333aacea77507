"""Every MEDUSA_CHAT_* environment variable is declared once (medusa_chat/envvars.py), read through that module,
and documented on one page (docs/configuration.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from medusa_chat import envvars

PACKAGE = Path(envvars.__file__).parent
PAGE = PACKAGE.parent / "docs" / "configuration.md"


def _env_names(path: Path) -> set[str]:
    """MEDUSA_CHAT_* names written as string constants in a module's code (docstrings aside)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(re.findall(r"\bMEDUSA_CHAT_[A-Z0-9_]+\b", node.value))
    return names


def test_the_page_lists_exactly_the_declared_variables() -> None:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## Environment variables") : text.index("## Reply settings")]
    documented = set(re.findall(r"^\| `(MEDUSA_CHAT_[A-Z0-9_]+)", section, flags=re.M))
    assert documented == set(envvars.VARIABLES)
    comparisons = section[section.index("### Comparison switches") : section.index("### Other variables")]
    for var in envvars.VARIABLES.values():
        assert (f"`{var.name}" in comparisons) == (var.kind == envvars.COMPARISON), var.name


def test_no_module_reads_the_environment_but_envvars() -> None:
    """os.environ / os.getenv reads of MEDUSA_CHAT_* names happen in envvars.py only."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "envvars.py":
            continue
        source = path.read_text(encoding="utf-8")
        for line_no, line in enumerate(source.splitlines(), 1):
            if re.search(r"(os\.environ|getenv)\b.*MEDUSA_CHAT_", line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line_no}")
    assert not found, found


def test_every_name_the_package_uses_is_declared() -> None:
    used = set()
    for path in PACKAGE.rglob("*.py"):
        used |= _env_names(path)
    used -= {"MEDUSA_CHAT_USER_TURN"}  # training/distill.py's separator text, not a variable
    assert used <= set(envvars.VARIABLES), used - set(envvars.VARIABLES)


def test_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEDUSA_CHAT_LEAN", raising=False)
    assert envvars.enabled("MEDUSA_CHAT_LEAN") and envvars.value("MEDUSA_CHAT_LEAN") is None
    monkeypatch.setenv("MEDUSA_CHAT_LEAN", " 0 ")
    assert not envvars.enabled("MEDUSA_CHAT_LEAN")
    monkeypatch.setenv("MEDUSA_CHAT_UI_HZ", "3")
    assert envvars.positive_rate("MEDUSA_CHAT_UI_HZ", 8.0) == 3.0
    for bad in ("0", "-1", "fast", "nan"):
        monkeypatch.setenv("MEDUSA_CHAT_UI_HZ", bad)
        with pytest.raises(ValueError, match="MEDUSA_CHAT_UI_HZ"):
            envvars.positive_rate("MEDUSA_CHAT_UI_HZ", 8.0)
    with pytest.raises(KeyError, match="not a declared"):
        envvars.value("MEDUSA_CHAT_NOT_A_SWITCH")


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("MEDUSA_CHAT_KQUANT_ACTIVATIONS", "64", "must be one of 32, 256, nested (got '64')"),
        ("MEDUSA_CHAT_QGEMM_ISA", "sse2", "must be one of avx2, avxvnni, avx512vnni (got 'sse2')"),
        ("MEDUSA_CHAT_THREADS", "many", "must be a positive integer (got 'many')"),
    ],
)
def test_a_bad_value_is_one_line_of_error_not_a_traceback(name: str, value: str, says: str) -> None:
    """The app (`medusa-chat ask` on the embedded model) stops with the variable named and the values it takes,
    as every user-facing error does (errors.SettingError): no stack trace, from the main thread or from the
    kernel library's background build."""
    import os
    import subprocess
    import sys

    env = {**os.environ, name: value, "HF_HUB_OFFLINE": "1", "MEDUSA_CHAT_AUTO_CALIBRATE": "0"}
    cmd = [sys.executable, "-m", "medusa_chat", "ask", "--max-new-tokens", "2", "hi"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode != 0
    assert f"error: {name} {says}" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr + run.stdout
