"""Triton kept out of a process that has no CUDA GPU.

Only the CUDA int4 load uses Triton (kernels/triton_*.py). On a CPU, torch imports it anyway for its own
compiler as soon as transformers loads its masking code (torch.nn.attention.flex_attention -> torch._dynamo),
which costs start-up time and, with Triton's nanobind bindings, ends every command with ~25 lines of
"nanobind: leaked ..." on stderr. Triton is optional to torch: where no CUDA device exists (and Triton's CPU
interpreter is not asked for: TRITON_INTERPRET=1, the tests'), `hide_without_cuda` makes `import triton` fail
as if it were not installed, so torch takes its Triton-less paths and nothing of Triton is loaded.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any


class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(
                f"No module named {name!r} (no CUDA device: medusa-chat leaves Triton out)"
            )
        return None


def hide_without_cuda() -> bool:
    """Hide Triton from this process where it could not run a kernel; True where it did."""
    if "triton" in sys.modules or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if any(isinstance(f, _Hidden) for f in sys.meta_path):
        return True
    import torch

    if torch.cuda.is_available():
        return False
    sys.meta_path.insert(0, _Hidden())
    return True
