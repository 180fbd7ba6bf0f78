"""Weight formats: q8 and q4 are llama.cpp's Q8_0 and Q4_0, and a rank encodes only its block."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_distx.sources import formats
from tvm_distx.sources.formats import EncodedPart, decode, encode, weight_format
from tvm_distx.errors import ArgumentError, ArgumentIndexError

gguf = pytest.importorskip("gguf")


def _weights(rows: int = 6, columns: int = 128) -> np.ndarray:
    rng = np.random.default_rng(1)
    values = rng.standard_normal((rows, columns)).astype(np.float32)
    values[0, :32] = 0.0              # a group of zeros
    values[1, :32] = -np.abs(values[1, :32])  # its largest value negative
    values[2, 32:64] *= 1e-3          # small values
    return values


@pytest.mark.parametrize("fmt, ggml", [("q8", "Q8_0"), ("q4", "Q4_0")])
def test_q8_and_q4_are_bit_for_bit_the_blocks_of_llama_cpp(fmt, ggml):
    values = _weights()
    kind = getattr(gguf.GGMLQuantizationType, ggml)
    blocks = gguf.quants.quantize(values, kind)           # (rows, groups * block bytes)
    groups = values.shape[1] // 32
    blocks = blocks.reshape(values.shape[0], groups, -1)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0]
    data = blocks[..., 2:].reshape(values.shape[0], -1)
    parts = encode(values, fmt)
    assert np.array_equal(parts["scale"], scale)
    assert np.array_equal(parts["data"].view(np.uint8), data)
    assert np.array_equal(decode(parts, fmt), gguf.quants.dequantize(blocks.reshape(
        values.shape[0], -1), kind))


#: The largest error of each format, relative to its group's largest magnitude: half a step
#: (q4's positive side clips at 7 steps: one step), plus the float16 scale's rounding.
@pytest.mark.parametrize("fmt, bound", [("q8", 1 / 254 + 2 ** -10), ("q4", 1 / 8 + 2 ** -10),
                                        ("bf16", 2 ** -8), ("f16", 2 ** -10)])
def test_decode_is_within_the_formats_rounding(fmt, bound):
    values = _weights()
    err = np.abs(decode(encode(values, fmt), fmt) - values)
    scale = np.abs(values).reshape(values.shape[0], -1, 32).max(axis=-1, keepdims=True)
    assert np.all(err.reshape(scale.shape[0], -1, 32) <= bound * scale + 1e-7)
    assert weight_format(fmt).bytes_per_value() < 4


class _Recorder:
    """A float source that records the blocks read from it."""

    def __init__(self, values: np.ndarray) -> None:
        self.values, self.reads, self.shape = values, [], values.shape

    def __getitem__(self, index):
        self.reads.append(tuple((s.start, s.stop) for s in index))
        return self.values[index]


@pytest.mark.parametrize("fmt", ["q8", "q4", "bf16"])
def test_a_block_of_an_encoded_part_reads_and_encodes_only_its_block(fmt):
    values = _weights()
    source = _Recorder(values)
    f = weight_format(fmt)
    whole = encode(values, fmt)
    for part in f.parts:
        per = 32 if part == "scale" else f.per_byte
        start, stop = 64 // per, 128 // per      # groups 2 and 3 of rows 2:4
        block = EncodedPart(source, f, part)[2:4, start:stop]
        assert block.shape == (2, stop - start) and block.dtype == f.part_dtype(part)
        assert source.reads == []                # slicing reads nothing
        assert np.array_equal(np.asarray(block), whole[part][2:4, start:stop])
        assert source.reads == [((2, 4), (64, 128))]
        source.reads.clear()


def test_a_block_that_cuts_a_group_is_refused():
    part = EncodedPart(_weights(), weight_format("q8"), "data")
    with pytest.raises(ArgumentIndexError, match="cuts one of its groups of 32"):
        part[:, 16:80]


def test_a_weight_whose_axis_is_no_multiple_of_the_group_and_unknown_formats_are_refused():
    with pytest.raises(ArgumentError, match="multiple of the group size 32"):
        weight_format("q4").check_shape("w", (4, 48))
    with pytest.raises(ArgumentError, match="'int3' is not a weight format"):
        weight_format("int3")
    assert weight_format("bfloat16") is formats.FORMATS["bf16"]
    assert weight_format("Q8_0") is formats.FORMATS["q8"]
