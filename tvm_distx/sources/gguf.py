"""llama.cpp's GGUF files, read into what a causal LM is served from.

:func:`open_gguf` reads a file's metadata and tensor table
(:mod:`~tvm_distx.sources.gguf_header`, with the ``gguf`` package's
enumerations) and returns a :class:`GGUFModel`:

* ``architecture`` and ``config``: the Hugging Face configuration of the model
  as a plain dict (the keys of ``LlamaConfig``, ``Qwen2Config``...), built from
  the ``<arch>.*`` metadata; :meth:`GGUFModel.hf_config` makes the
  ``transformers`` object of it (``transformers`` is imported only there);
* ``tensors``: each weight under its Hugging Face name
  (``model.layers.0.self_attn.q_proj.weight``...) as a :class:`GGUFWeight`,
  in the format it is stored in (:mod:`tvm_distx.sources.formats`), its parts
  deferred: nothing is read until a block of a part is converted with
  ``np.asarray``, and then only that block's bytes of the memory-mapped file;
* ``tokenizer``: the vocabulary of the metadata (:mod:`~tvm_distx.sources.gguf_tokenizer`).

=================  =================  ==============================================
GGUF tensor type   served as          parts
=================  =================  ==============================================
``F32``            ``f32``            ``data``
``F16``            ``f16``            ``data``
``BF16``           ``bf16``           ``data``
``Q8_0``           ``q8``             ``data`` and ``scale``, split out of the blocks
``Q4_0``           ``q4``             ``data`` and ``scale``, split out of the blocks
other types        refused            or re-encoded at load with ``requantize=`` (lossy)
=================  =================  ==============================================

A ``Q8_0`` (``Q4_0``) block of 34 (18) bytes holds a float16 scale, then the 32
values of one group (16 bytes of nibble pairs): exactly a group of our ``q8``
(``q4``) format with its scale stored apart, so the bytes are served as they
are, never widened. The logical shape of a tensor is its GGUF shape reversed
(GGUF lists the fastest axis first), which is the Hugging Face ``(out, in)``
of a linear: no transpose.

llama.cpp's converter permutes the rows of the ``llama`` architecture's query
and key projections (weights and biases) so that its rotary embedding can
rotate adjacent pairs: within each head of ``d`` rows, row ``2 j + t`` of the
file is row ``t d/2 + j`` of the Hugging Face weight. The reader undoes it with
a row map inside the deferred part (:attr:`GGUFBlock.heads`), so a block of
rows still reads only its rows, and the quantized parts too (a row holds whole
groups). ``qwen2`` and ``qwen3`` files are not permuted (they rotate halves, as
Hugging Face does).

Only ``numpy`` is imported with this module; ``gguf`` when a file is opened
or a tensor of a type other than the five is decoded (by the ``gguf``
package's codecs), ``transformers`` by :meth:`GGUFModel.hf_config`. Reading a
block of a served type needs numpy only.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from tvm_distx.sources.formats import (FORMATS, EncodedPart, WeightFormat, decode, sliced_bounds,
                                      weight_format)
from tvm_distx.sources.gguf_header import TensorInfo, read_header
from tvm_distx.sources.gguf_tokenizer import GGUFTokenizer, read_tokenizer
from tvm_distx.errors import ArgumentError, ArgumentIndexError

__all__ = ["ARCHITECTURES", "SERVED_TYPES", "GGUFBlock", "GGUFModel", "GGUFWeight", "open_gguf"]

logger = logging.getLogger(__name__)

#: The GGUF tensor types served as stored, and their format.
SERVED_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8", "Q4_0": "q4"}

#: metadata arrays longer than this (the vocabulary) are left out of ``GGUFModel.metadata``
_LONG = 64


@dataclass(frozen=True)
class _Architecture:
    """What differs between the supported architectures."""

    model_type: str  # the Hugging Face config's model_type
    hf_class: str
    permuted_qk: bool = False  # llama.cpp's converter permuted attn_q/attn_k rows
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    qkv_bias: bool = False  # q/k/v projections always have biases (Qwen2)
    head_dim_key: bool = True  # the config has head_dim (Qwen2's only when it differs)


#: The GGUF architectures read (``general.architecture``). Mistral's files are ``llama``.
ARCHITECTURES = {
    "llama": _Architecture("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": _Architecture("qwen2", "Qwen2ForCausalLM", qkv_bias=True, head_dim_key=False),
    "qwen3": _Architecture("qwen3", "Qwen3ForCausalLM", qk_norm=True),
}

#: GGUF tensor names -> Hugging Face parameter names (without ``.weight``/``.bias``).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)$")
#: llama.cpp's precomputed Llama 3 rope factors: folded into the config, not a parameter.
_ROPE_FACTORS = "rope_freqs.weight"


# ------------------------------------------------------------------- the deferred blocks
@dataclass(frozen=True)
class GGUFBlock:
    """One part of one GGUF tensor, or a block of it, not read yet.

    ``part`` is ``"data"`` or ``"scale"`` (the parts of the tensor's format,
    :class:`~tvm_distx.sources.formats.WeightFormat`), or ``"values"``: the
    tensor decoded to float32 (any type the ``gguf`` package decodes).
    Slicing (step-1 slices) composes and reads nothing; ``np.asarray`` maps
    the file and copies out only the bytes of the block's rows and groups. A
    block of a quantized ``data`` part must hold whole groups.

    Attributes
    ----------
    path : pathlib.Path
        The ``.gguf`` file.
    tensor : str
        The tensor's name in the file (``"blk.0.attn_q.weight"``).
    offset : int
        The byte offset of the tensor's data in the file.
    ggml_type : str
        Its GGUF type (``"Q8_0"``).
    block : tuple of (int, int)
        Values and bytes per block of that type (``(32, 34)`` for ``Q8_0``).
    stored_shape : tuple of int
        The tensor's logical shape, Hugging Face order (GGUF's reversed).
    part : str
        ``"data"``, ``"scale"`` or ``"values"``.
    heads : int
        When not 0, the rows (the elements of a 1-D tensor) are served in
        Hugging Face order, undoing llama.cpp's rotary permutation in this
        many heads.
    bounds : tuple of (int, int)
        The block of the part this object stands for.
    """

    __distx_deferred__: ClassVar[bool] = True

    path: Path
    tensor: str
    offset: int
    ggml_type: str
    block: tuple[int, int]
    stored_shape: tuple[int, ...]
    part: str
    heads: int = 0
    bounds: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.bounds:
            object.__setattr__(self, "bounds", tuple((0, d) for d in self.part_shape()))

    # -- what the part is
    @property
    def _format(self) -> WeightFormat | None:
        name = SERVED_TYPES.get(self.ggml_type)
        return FORMATS[name] if name else None

    def part_shape(self) -> tuple[int, ...]:
        """The shape of the whole part."""
        if self.part == "values":
            return self.stored_shape
        return self._format.part_shape(self.part, self.stored_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.bounds)

    @property
    def ndim(self) -> int:
        return len(self.bounds)

    @property
    def dtype(self) -> np.dtype:
        if self.part == "values":
            return np.dtype("float32")
        return self._format.part_dtype(self.part)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def _per_block(self) -> int:
        """Elements of this part along the last axis per block of the file."""
        values = self.block[0]
        if self.part == "values" or values == 1:
            return values
        return 1 if self.part == "scale" else values // self._format.per_byte

    # -- slicing and reading
    def __getitem__(self, index) -> "GGUFBlock":
        per = self._per_block() if self.part != "values" else 1
        bounds = sliced_bounds(self.bounds, index, per,
                               f"the {self.part} of GGUF tensor {self.tensor} ({self.ggml_type})",
                               self.block[0])
        return GGUFBlock(self.path, self.tensor, self.offset, self.ggml_type, self.block,
                         self.stored_shape, self.part, self.heads, tuple(bounds))

    def row_map(self) -> np.ndarray | None:
        """The file's row (1-D: element) of each served one, or ``None`` when unpermuted."""
        if not self.heads:
            return None
        rows = self.stored_shape[0]
        size = rows // self.heads
        served = np.arange(rows)
        head, within = np.divmod(served, size)
        half, pair = np.divmod(within, size // 2)  # served row t d/2 + j is file row 2 j + t
        return head * size + 2 * pair + half

    def read(self) -> np.ndarray:
        """Read this block of the file (only its bytes) and decode it to :attr:`dtype`."""
        if 0 in self.shape:
            return np.empty(self.shape, self.dtype)
        values, nbytes = self.block
        *lead, k = self.stored_shape
        file = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset,
                         shape=(*lead, k // values, nbytes))
        *rows, (c0, c1) = self.bounds
        per = self._per_block()
        g0, g1 = c0 // per, -(-c1 // per)  # the file blocks this block's columns are in
        index: list[Any] = [slice(a, b) for a, b in rows] + [slice(g0, g1)]
        rows_map = self.row_map()
        if rows_map is not None:
            if lead:
                index[0] = rows_map[rows[0][0]:rows[0][1]]
            elif values == 1:
                index[-1] = rows_map[c0:c1]
                g0, c0, c1 = 0, 0, c1 - c0
            else:
                raise ArgumentIndexError(
                    f"GGUF tensor {self.tensor}: a permuted 1-D tensor of type "
                    f"{self.ggml_type} cannot be read", hint="convert the file with F32 biases")
        raw = np.array(file[tuple(index)])  # a copy of only these bytes, the map let go
        del file
        return self._decode(raw, c0 - g0 * per, c1 - g0 * per)

    def _decode(self, raw: np.ndarray, start: int, stop: int) -> np.ndarray:
        """This part of the file blocks ``raw`` (``(..., blocks, bytes)``), columns cut."""
        lead = raw.shape[:-2]
        fmt = self._format
        if self.part == "values" and fmt is None:
            import gguf

            kind = gguf.GGMLQuantizationType[self.ggml_type]
            out = gguf.quants.dequantize(raw.reshape(*lead, -1), kind).astype(np.float32)
        elif self.part == "scale":
            out = raw[..., :2].copy().view(np.float16).reshape(*lead, -1)
        elif fmt.quantized:
            data = raw[..., 2:].reshape(*lead, -1)
            out = data.view(np.int8) if fmt.name == "q8" else data
            if self.part == "values":
                scale = raw[..., :2].copy().view(np.float16).reshape(*lead, -1)
                out = decode({"data": out, "scale": scale}, fmt)
        else:
            stored = fmt.part_dtype("data")
            out = raw.view(np.uint16 if stored.itemsize == 2 else np.uint32).view(stored)
            out = out.reshape(*lead, -1)
            if self.part == "values":
                out = out.astype(np.float32)
        return np.ascontiguousarray(out[..., start:stop])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        block = self.read()
        return block if dtype is None else block.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return (f"GGUFBlock({self.path.name}:{self.tensor} {self.ggml_type} {self.part}, "
                f"shape={list(self.shape)} of {list(self.part_shape())})")

    # -- for a bundle's links: each rank reopens its block from this description
    def to_json(self) -> dict:
        """This block as JSON (see :meth:`from_json`)."""
        return {"path": str(self.path), "tensor": self.tensor, "offset": self.offset,
                "ggml_type": self.ggml_type, "block": list(self.block),
                "stored_shape": list(self.stored_shape), "part": self.part,
                "heads": self.heads, "start": [a for a, _ in self.bounds],
                "stop": [b for _, b in self.bounds]}

    @classmethod
    def from_json(cls, data: dict) -> "GGUFBlock":
        """The block :meth:`to_json` describes (nothing read)."""
        return cls(Path(data["path"]), data["tensor"], int(data["offset"]), data["ggml_type"],
                   tuple(data["block"]), tuple(data["stored_shape"]), data["part"],
                   int(data["heads"]), tuple(zip(data["start"], data["stop"])))


@dataclass(frozen=True)
class GGUFWeight:
    """One weight of a GGUF file, in its format, nothing read.

    Attributes
    ----------
    name : str
        Its name in the file (``"blk.0.attn_q.weight"``).
    shape : tuple of int
        Its logical float shape, Hugging Face order (``(out, in)`` for a linear).
    format : WeightFormat
        The format it is served in: its GGUF type's (``Q8_0`` -> ``q8``), or
        ``requantize``'s for the other types.
    parts : dict
        The format's parts (``"data"``, ``"scale"``), each a deferred array in
        the layout of :mod:`tvm_distx.sources.formats`: a :class:`GGUFBlock`,
        or an :class:`~tvm_distx.sources.formats.EncodedPart` of the decoded
        values when re-encoded.
    ggml_type : str
        Its GGUF type.
    values : GGUFBlock
        The weight decoded to float32, deferred.
    """

    name: str
    shape: tuple[int, ...]
    format: WeightFormat
    parts: dict[str, Any]
    ggml_type: str
    values: GGUFBlock


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file's model, read (see the module doc).

    Attributes
    ----------
    path : pathlib.Path
        The file.
    architecture : str
        ``general.architecture`` (one of :data:`ARCHITECTURES`).
    config : dict
        The Hugging Face configuration's keys (``model_type``, ``hidden_size``,
        ``rope_parameters``...); :meth:`hf_config` builds the object.
    tensors : dict of str to GGUFWeight
        The weights by Hugging Face parameter name. A tied model (no
        ``output.weight``) has no ``lm_head.weight``: its LM head is
        ``model.embed_tokens.weight`` (``config["tie_word_embeddings"]``).
    tokenizer : GGUFTokenizer
        The vocabulary and special tokens of the metadata.
    metadata : dict
        The file's key-value metadata, its long arrays (the vocabulary) left out.
    """

    path: Path
    architecture: str
    config: dict
    tensors: dict[str, GGUFWeight]
    tokenizer: GGUFTokenizer
    metadata: dict = field(repr=False)

    def hf_config(self):
        """The ``transformers`` configuration object of :attr:`config`."""
        import transformers

        keys = dict(self.config)
        return transformers.AutoConfig.for_model(keys.pop("model_type"), **keys)


# ------------------------------------------------------------------------ reading a file
def open_gguf(path, requantize: str | WeightFormat | None = None) -> GGUFModel:
    """Read a GGUF file's configuration, tokenizer and tensor table; no weight is read.

    Parameters
    ----------
    path : path
        A ``.gguf`` file written by llama.cpp's converter or ``llama-quantize``.
    requantize : str, optional
        The format (``"q8"``, ``"q4"``, ``"f16"``, ``"bf16"``, ``"f32"``) for
        tensors whose GGUF type is not served as stored (``Q4_K``, ``Q6_K``,
        ``Q5_0``...): each rank decodes its block with the ``gguf`` package and
        encodes it in that format, which loses precision. By default such a
        tensor is an error. Tensors of the served types keep their format.

    Raises
    ------
    ArgumentError
        If the file is missing or not a GGUF file, holds an architecture other
        than those of :data:`ARCHITECTURES`, misses a tensor or a configuration
        key, or holds a tensor of a type that is not served (without
        ``requantize``).
    """
    path = Path(path)
    header = read_header(path)
    metadata = {key: value.tolist() if isinstance(value, np.ndarray) else value
                for key, value in header.fields.items()
                if not (isinstance(value, (list, np.ndarray)) and len(value) > _LONG)}
    if int(metadata.get("split.count", 1)) > 1:
        raise ArgumentError(f"{path} is one of {metadata['split.count']} split GGUF files",
                            hint="merge them into one file with "
                            "`llama-gguf-split --merge first-part.gguf merged.gguf`")
    arch = str(metadata.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ArgumentError(f"{path} holds a model of architecture {arch!r}, which tvm-distx "
                            f"does not read (it reads {', '.join(ARCHITECTURES)})",
                            hint="convert a model of one of these architectures, or serve "
                            "the model's Hugging Face checkpoint with from_pretrained")
    fmt = None if requantize is None else weight_format(requantize, "requantize")
    tensors = _weights(path, arch, header.tensors, metadata, fmt)
    factors = header.tensors.get(_ROPE_FACTORS)
    if factors is not None:
        factors = np.asarray(_block(path, factors, "values", 0))
    config = _config(path, arch, metadata, tensors, factors)
    tokenizer = read_tokenizer(header.fields)
    if tokenizer.tokens and len(tokenizer.tokens) != config["vocab_size"]:
        logger.warning("%s: %d tokens for an embedding of %d rows", path,
                       len(tokenizer.tokens), config["vocab_size"])
    logger.info("gguf %s: %s, %d tensors (%s)", path, arch, len(tensors),
                ", ".join(sorted({w.ggml_type for w in tensors.values()})))
    return GGUFModel(path, arch, config, tensors, tokenizer, metadata)


def _weights(path: Path, arch: str, stored: dict, metadata: dict, fmt) -> dict:
    """Every tensor of the file under its Hugging Face name."""
    spec = ARCHITECTURES[arch]
    heads = _key(path, metadata, f"{arch}.attention.head_count")
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    out: dict[str, GGUFWeight] = {}
    for name, info in stored.items():
        if name == _ROPE_FACTORS:
            continue
        hf, permute = _hf_name(path, arch, name), 0
        if spec.permuted_qk and ".attn_q." in name:
            permute = heads
        elif spec.permuted_qk and ".attn_k." in name:
            permute = kv_heads
        out[hf] = _weight(path, info, permute, fmt)
    layers = _key(path, metadata, f"{arch}.block_count")
    for hf, gguf_name in _expected(spec, layers, "output.weight" in stored).items():
        if hf not in out:
            raise ArgumentError(f"{path} has no tensor {gguf_name} ({hf}), which a {arch} "
                                "model needs", hint="convert the whole model again")
    return out


def _hf_name(path: Path, arch: str, name: str) -> str:
    if match := _LAYER_TENSOR.match(name):
        layer, kind, suffix = match.groups()
        if kind in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    elif (match := _GLOBAL_TENSOR.match(name)) and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    raise ArgumentError(f"{path}: tensor {name} of a {arch} model has no Hugging Face "
                        "counterpart tvm-distx knows",
                        hint="convert the model with llama.cpp's convert_hf_to_gguf.py "
                        "without fused or extra tensors")


def _expected(spec: _Architecture, layers: int, untied: bool) -> dict[str, str]:
    """The Hugging Face parameters a model needs, with their GGUF names."""
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}
    if untied:
        names["lm_head.weight"] = "output.weight"
    kinds = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
             "ffn_up", "ffn_down"] + (["attn_q_norm", "attn_k_norm"] if spec.qk_norm else [])
    for i in range(layers):
        for kind in kinds:
            names[f"model.layers.{i}.{_LAYER_NAMES[kind]}.weight"] = f"blk.{i}.{kind}.weight"
        if spec.qkv_bias:
            for kind in ("attn_q", "attn_k", "attn_v"):
                names[f"model.layers.{i}.{_LAYER_NAMES[kind]}.bias"] = f"blk.{i}.{kind}.bias"
    return names


def _block(path: Path, info: TensorInfo, part: str, heads: int) -> GGUFBlock:
    return GGUFBlock(path, info.name, info.offset, info.ggml_type, info.block, info.shape,
                     part, heads)


def _weight(path: Path, info: TensorInfo, heads: int, fmt: WeightFormat | None) -> GGUFWeight:
    """One tensor as a weight in its format (or ``fmt``), its parts deferred."""
    kind, shape = info.ggml_type, info.shape
    if heads and (shape[0] % (2 * heads)):
        raise ArgumentError(f"{path}: tensor {info.name} has {shape[0]} rows, not a whole "
                            f"number of rotary pairs in each of {heads} heads",
                            hint="check the file's attention.head_count(_kv) metadata")
    values = _block(path, info, "values", heads)
    if kind in SERVED_TYPES:
        served = FORMATS[SERVED_TYPES[kind]]
        parts = {p: _block(path, info, p, heads) for p in served.parts}
        return GGUFWeight(info.name, shape, served, parts, kind, values)
    if fmt is None:
        raise ArgumentError(
            f"{path}: tensor {info.name} is of GGUF type {kind}, which tvm-distx does not "
            f"serve as stored (it serves {', '.join(SERVED_TYPES)})",
            hint="requantize the file with `llama-quantize --pure model.gguf out.gguf Q8_0` "
            "(or Q4_0), convert the model with --outtype f16, or open it with "
            "requantize='q8' to re-encode such tensors at load (lossy)")
    try:
        fmt.check_shape(info.name, shape)
    except ArgumentError:
        fmt = FORMATS["f32"]  # a tensor that cannot be grouped (a norm): float32
    parts = {p: EncodedPart(values, fmt, p) for p in fmt.parts}
    return GGUFWeight(info.name, shape, fmt, parts, kind, values)


# --------------------------------------------------------------------- the configuration
def _key(path: Path, metadata: dict, key: str):
    if key not in metadata:
        raise ArgumentError(f"{path} has no metadata key {key}",
                            hint="convert the model with a recent llama.cpp convert_hf_to_gguf.py")
    value = metadata[key]
    if isinstance(value, list):
        raise ArgumentError(f"{path}: {key} varies by layer ({value[:4]}...), which tvm-distx "
                            "does not serve", hint="use a model with the same shape in every "
                            "layer")
    return value


def _config(path: Path, arch: str, metadata: dict, tensors: dict, factors) -> dict:
    """The Hugging Face configuration's keys, from the ``<arch>.*`` metadata."""
    spec = ARCHITECTURES[arch]
    key = (lambda name: _key(path, metadata, f"{arch}.{name}"))
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    rotary = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ArgumentError(f"{path}: rotary embedding on {rotary} of {head_dim} dimensions "
                            f"per head, which a {arch} model does not do",
                            hint="use a model that rotates whole heads")
    eps = metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    config = {
        "model_type": spec.model_type,
        "architectures": [spec.hf_class],
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_parameters": _rope(path, arch, metadata, factors, head_dim),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    if not spec.head_dim_key and head_dim == hidden // heads:
        del config["head_dim"]
    if f"{arch}.context_length" in metadata:
        config["max_position_embeddings"] = int(metadata[f"{arch}.context_length"])
    if not spec.qkv_bias:
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
    if arch == "llama":
        config["mlp_bias"] = "model.layers.0.mlp.up_proj.bias" in tensors
    return config


def _rope(path: Path, arch: str, metadata: dict, factors, head_dim: int) -> dict:
    """``rope_parameters``: the base, and the scaling the file names or implies."""
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = str(metadata.get(f"{arch}.rope.scaling.type", "none"))
    if factors is not None:
        return {"rope_type": "llama3", "rope_theta": theta,
                **_llama3_rope(path, factors, theta, head_dim)}
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta,
                "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    raise ArgumentError(f"{path}: rope scaling {scaling!r}, which tvm-distx does not read "
                        "from GGUF files", hint="use a model without rope scaling, or its "
                        "Hugging Face checkpoint with from_pretrained")


def _llama3_rope(path: Path, factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """Llama 3's rope scaling, recovered from llama.cpp's per-frequency factors.

    A frequency of wavelength ``w`` is divided by 1 when ``w`` is below ``old / high``,
    by ``factor`` above ``old / low``, and in between by ``1 / ((1 - s) / factor + s)``
    with ``s = (old / w - low) / (high - low)``. Only ``old / (high - low)`` and
    ``low / (high - low)`` matter (scaling ``old``, ``low`` and ``high`` together gives
    the same factors), so ``low`` is taken as 1; the two are fitted to the in-between
    factors, of which there must be two.
    """
    factor = float(factors.max())
    wavelength = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    between = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if between.sum() < 2 or factor <= 1:
        raise ArgumentError(f"{path}: its Llama 3 rope factors ({_ROPE_FACTORS}) do not "
                            "determine the rope scaling", hint="use a model without rope "
                            "scaling, or its Hugging Face checkpoint with from_pretrained")
    smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelength[between], smooth, 1)  # s = a / w - b
    low = 1.0
    high = low + low / -intercept
    return {"factor": round(factor, 4), "low_freq_factor": low,
            "high_freq_factor": round(float(high), 4),
            "original_max_position_embeddings": int(round(slope * low / -intercept))}
