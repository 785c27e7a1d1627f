"""A GGUF file's header read straight from its memory map: the metadata as plain Python
values and the tensor directory as views of the file.

The gguf package's GGUFReader builds a numpy object for every part of every field, the
49k-entry vocabulary arrays included: ~3 s for the default model on a fast host, 15-20 s on
a slow one, most of a model's load. Here each field is one struct.unpack_from (numeric arrays
one np.frombuffer), which reads the same header in a small fraction of that. The gguf package
still supplies the format's constants (value and tensor types, block sizes) and decodes the
tensors; tests/test_gguf_file.py checks every field and tensor against GGUFReader's.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)

_SCALARS = {  # value type -> struct code
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
_NUMPY = {  # value type -> numpy dtype, for arrays read in one go
    GGUFValueType.UINT8: "u1", GGUFValueType.INT8: "i1", GGUFValueType.UINT16: "u2",
    GGUFValueType.INT16: "i2", GGUFValueType.UINT32: "u4", GGUFValueType.INT32: "i4",
    GGUFValueType.FLOAT32: "f4", GGUFValueType.UINT64: "u8", GGUFValueType.INT64: "i8",
    GGUFValueType.FLOAT64: "f8", GGUFValueType.BOOL: "?",
}
# Tensor types stored as plain numbers; every other type is blocks of bytes.
_PLAIN_TENSORS = {
    GGMLQuantizationType.F32: "f4", GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F64: "f8",
    GGMLQuantizationType.I8: "i1", GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands; the message says where."""


@dataclass
class GGUFTensor:
    """One tensor of the directory, with the attributes of gguf's ReaderTensor we use."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # the file's order: columns first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a view of the memory-mapped file


class GGUFFile:
    """`fields`: every metadata key -> its value (int, float, bool, str, or a list of them);
    `tensors`: the directory in file order; `data`: the file's np.memmap."""

    def __init__(self, path: str):
        self.data = np.memmap(path, mode="r")
        self._buffer = memoryview(self.data._mmap) if self.data.size else memoryview(b"")
        self._order = "<"
        self.fields: dict[str, object] = {}
        offset = self._read_preamble()
        tensor_count, kv_count = self._unpack("QQ", offset)
        offset += 16
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (value_type,), offset = self._unpack("I", offset), offset + 4
            self.fields[key], offset = self._value(value_type, offset, key)
        directory = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (dims,), offset = self._unpack("I", offset), offset + 4
            shape = self._unpack(f"{dims}Q", offset)
            offset += 8 * dims
            tensor_type, relative = self._unpack("IQ", offset)
            offset += 12
            directory.append((name, shape, tensor_type, relative))
        alignment = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(start, *entry) for entry in directory]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise GGUFFormatError("two tensors have the same name")

    def _read_preamble(self) -> int:
        if len(self._buffer) < 24 or struct.unpack_from("<I", self._buffer, 0)[0] != GGUF_MAGIC:
            raise GGUFFormatError("no GGUF magic at the start")
        version = struct.unpack_from("<I", self._buffer, 4)[0]
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order = ">"
            version = struct.unpack_from(">I", self._buffer, 4)[0]
        if version not in SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} (this reader knows 2 and 3)")
        return 8

    def _unpack(self, codes: str, offset: int) -> tuple:
        try:
            return struct.unpack_from(self._order + codes, self._buffer, offset)
        except struct.error:
            raise GGUFFormatError(f"the header ends early (at byte {offset})") from None

    def _string(self, offset: int, errors: str = "strict") -> tuple[str, int]:
        (length,) = self._unpack("Q", offset)
        end = offset + 8 + length
        if end > len(self._buffer):
            raise GGUFFormatError(f"a string at byte {offset} runs past the end of the file")
        try:
            return str(self._buffer[offset + 8:end], "utf-8", errors), end
        except UnicodeDecodeError:
            raise GGUFFormatError(f"a name at byte {offset} is not UTF-8") from None

    def _value(self, value_type: int, offset: int, key: str) -> tuple[object, int]:
        try:
            kind = GGUFValueType(value_type)
        except ValueError:
            raise GGUFFormatError(f"field {key}: unknown value type {value_type}") from None
        if kind == GGUFValueType.STRING:  # a vocabulary's odd byte is not worth the file
            return self._string(offset, errors="replace")
        if kind in _SCALARS:
            code = _SCALARS[kind]
            return self._unpack(code, offset)[0], offset + struct.calcsize(code)
        item_type, count = self._unpack("IQ", offset)
        offset += 12
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[GGUFValueType(item_type)]).newbyteorder(self._order)
            end = offset + count * dtype.itemsize
            if end > len(self._buffer):
                raise GGUFFormatError(f"field {key}: its array runs past the end of the file")
            return np.frombuffer(self._buffer, dtype, count, offset).tolist(), end
        items = []
        for _ in range(count):
            item, offset = self._value(item_type, offset, key)
            items.append(item)
        return items, offset

    def _tensor(self, start: int, name: str, shape: tuple, tensor_type: int,
                relative: int) -> GGUFTensor:
        try:
            kind = GGMLQuantizationType(tensor_type)
            block, type_size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name}: unknown type {tensor_type}") from None
        n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        n_bytes = n_elements * type_size // block
        offset = start + relative
        if offset + n_bytes > self.data.size:
            raise GGUFFormatError(f"file is truncated: tensor {name} ends past byte {self.data.size}")
        dims = tuple(reversed(shape))
        raw = self.data[offset:offset + n_bytes]
        if kind in _PLAIN_TENSORS:
            data = raw.view(np.dtype(_PLAIN_TENSORS[kind]).newbyteorder(self._order)).reshape(dims)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(dims, kind))
        return GGUFTensor(name, kind, np.array(shape, dtype=np.uint64), n_elements, n_bytes,
                          offset, data)
