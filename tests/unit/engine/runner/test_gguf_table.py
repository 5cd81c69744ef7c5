"""The GGUF tensor table read by walking the header matches ``gguf.GGUFReader``'s, byte for byte:
on the embedded model's file and on a written file with every metadata value kind (nested arrays,
string arrays, a non-default alignment) and plain, integer and quantised tensors."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from stages.engine.runner.gguf_table import gguf_tensors
from stages.model_info import embedded_gguf_path


def _same_as_reader(path) -> int:
    ours = gguf_tensors(path)
    theirs = GGUFReader(str(path)).tensors
    assert list(ours) == [t.name for t in theirs]
    for t in theirs:
        mine = ours[t.name]
        assert mine.tensor_type == t.tensor_type, t.name
        assert mine.data.shape == t.data.shape and mine.data.dtype == t.data.dtype, t.name
        assert np.array_equal(mine.data.view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist())), t.name
    return len(theirs)


def test_the_embedded_models_tensors_match_ggufs_reader() -> None:
    assert _same_as_reader(embedded_gguf_path()) == 272


# The padding string moves where the data section starts, so some of the files need the alignment.
@pytest.mark.parametrize("alignment", [32, 256])
@pytest.mark.parametrize("pad", range(0, 256, 32))
def test_a_file_with_every_metadata_kind_matches_ggufs_reader(tmp_path, alignment: int, pad: int) -> None:
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_string("a.pad", "p" * pad)
    if alignment != 32:
        w.add_custom_alignment(alignment)
    w.add_uint8("a.u8", 7)
    w.add_int16("a.i16", -3)
    w.add_uint64("a.u64", 2**40)
    w.add_float64("a.f64", 0.5)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo")
    w.add_array("a.strings", ["", "x", "ünïcode", "y" * 300])
    w.add_array("a.ints", [1, 2, 3])
    w.add_array("a.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q = rng.integers(0, 256, size=(4, 2 * 20), dtype=np.uint8)  # 4 rows of two Q4_1 blocks
    w.add_tensor("q4_1", q, raw_dtype=GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert _same_as_reader(path) == 4
    assert gguf_tensors(path)["q4_1"].data.shape == (4, 40)


def test_not_a_gguf_file_is_refused(tmp_path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_tensors(path)
