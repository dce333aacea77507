"""The C structs the drafters share (csrc/drafting.h): a Q8_0 block linear with its bias, and a token embedding
as the C drafting code reads it (an fp32 table, the lm_head's Q8_0 blocks, or a lookup called back from C)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_p, _i = ctypes.c_void_p, ctypes.c_int


class Q8Lin(ctypes.Structure):  # drafting.h Q8Lin: a Q8_0 block linear's buffers and an fp32 bias
    _fields_ = [("qs", _p), ("d", _p), ("ws", _p), ("bias", _p)]


_LOOKUP = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)  # drafting.h Embed.lookup


class EmbedStruct(ctypes.Structure):  # drafting.h Embed: an fp32 table, Q8_0 blocks (table NULL) or a lookup callback
    _fields_ = [("table", _p), ("qs", _p), ("d", _p), ("group", _i), ("lookup", _LOOKUP)]


def embed_struct(embed: Any, callback: bool = False) -> tuple[EmbedStruct, Any] | None:
    """The C description of a token embedding (drafting.h Embed) and the object that keeps its buffers alive: the
    lm_head's Q8_0 blocks (a BlockEmbedding) or an fp32 table; with `callback`, any other embedding module (a GGUF
    file's K-quant or F16 rows, kept as stored) through its own lookup called back from C, one row at a time
    (for a caller that looks up a few rows a step from the drafting thread: EAGLE's spine); else None."""
    from medusa_chat.kernels.block_linears import BlockEmbedding

    if isinstance(embed, BlockEmbedding):
        t = embed.table
        return EmbedStruct(None, t.qs.data_ptr(), t.d.data_ptr(), t.group, _LOOKUP()), t
    if isinstance(embed, torch.nn.Embedding) and embed.weight.dtype == torch.float32:  # a full table
        keep = embed.weight.detach().contiguous()
        return EmbedStruct(keep.data_ptr(), None, None, 0, _LOOKUP()), keep
    width = getattr(embed, "embedding_dim", None)
    if not callback or not isinstance(embed, torch.nn.Module) or not width:
        return None
    row_bytes = int(width) * 4

    def lookup(tok: int, out: int) -> None:
        # (an exception cannot cross into C: a row that fails is zeros, which can only make a worse guess, and
        # guesses never change a reply)
        try:
            with torch.inference_mode():
                row = embed(torch.tensor([tok])).to(torch.float32).contiguous()
            ctypes.memmove(out, row.data_ptr(), row_bytes)
        except Exception:  # noqa: BLE001 - see above
            ctypes.memset(out, 0, row_bytes)

    fn = _LOOKUP(lookup)
    return EmbedStruct(None, None, None, 0, fn), (embed, fn)  # (the callback object must outlive the C calls)
