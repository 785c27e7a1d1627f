"""gguf_file.GGUFFile reads the same header as the gguf package's GGUFReader: every field's
value and every tensor's directory entry and bytes, on the default model and on a file that
holds every value type; broken files are refused with a message saying what is wrong."""
import gguf
import numpy as np
import pytest

from pagedllm.weights import default_model_path
from pagedllm.weights.gguf_file import GGUFFile, GGUFFormatError


def _reader_fields(reader: gguf.GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def _assert_same_as_reader(path: str) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.fields == _reader_fields(theirs)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type
        assert mine.shape.tolist() == ref.shape.tolist()
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == \
               (ref.n_elements, ref.n_bytes, ref.data_offset)
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, ref.data)
    return ours


def test_default_model_header_matches_the_gguf_package():
    ours = _assert_same_as_reader(default_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert ours.fields["general.architecture"] == "llama"


def _every_value_type(path) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.25])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.bools", [True, False])
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32),
                              gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_every_value_type_and_tensor_kind_match_the_gguf_package(tmp_path):
    ours = _assert_same_as_reader(_every_value_type(tmp_path / "all.gguf"))
    assert ours.fields["t.u64"] == 2**63 + 5 and ours.fields["t.strs"] == ["a", "", "ü"]
    assert ours.fields["t.bool"] is True
    assert ours.tensors[0].data.tolist() == np.arange(12).reshape(3, 4).tolist()


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path):
    path = _every_value_type(tmp_path / "all.gguf")
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-40])  # past the last tensor's padding
    with pytest.raises(GGUFFormatError, match="truncated: tensor q8"):
        GGUFFile(str(cut))


@pytest.mark.parametrize("size", [30, 100, 400, 2000])
def test_a_header_cut_anywhere_is_refused_not_misread(tmp_path, size):
    data = open(default_model_path(), "rb").read(size)
    cut = tmp_path / "head.gguf"
    cut.write_bytes(data)
    with pytest.raises(GGUFFormatError, match="ends early|runs past|truncated"):
        GGUFFile(str(cut))


def test_not_gguf_and_unknown_version_are_refused(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all, just words" * 3)
    with pytest.raises(GGUFFormatError, match="no GGUF magic"):
        GGUFFile(str(junk))
    future = tmp_path / "v9.gguf"
    future.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(40))
    with pytest.raises(GGUFFormatError, match="version 9"):
        GGUFFile(str(future))


def test_bad_alignment_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    writer.add_uint32("general.alignment", 24)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFFormatError, match="alignment 24"):
        GGUFFile(str(tmp_path / "a.gguf"))
