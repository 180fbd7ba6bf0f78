"""Decoder layers of the kinds TVM's distributed passes handle, written for our drop-in tests.

One attention layer (RMS norm, q/k/v projections with their output features
split by annotation, rotary embedding, attention over all positions, the output
projection, a residual), in three forms:

* :func:`kv_decoder`: Relax operators, with keys and values going through TVM's
  KV-cache builtins (``vm.builtin.attention_kv_cache_append`` then ``_view``);
* :func:`plain_decoder`: the same layer without the cache (runnable by
  ``DistExecutable.run``, which takes tensors only);
* :func:`tir_decoder`: the layer written with ``call_tir`` to TIR functions: the
  norm and the rotary embedding hand-written (extents written as plain ints,
  int32 in TIR, as hand-written kernels often are; the rotary embedding takes
  the first position as a scalar argument), the rest from ``LegalizeOps``.

Each takes the sequence length: an int, or a name for a symbolic one. Sizes:
hidden 16, 4 heads of 4, a 2-device mesh.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

HIDDEN, HEADS, HEAD_DIM, MAX_POS = 16, 4, 4, 32
WEIGHTS = ("g", "wq", "wk", "wv", "wo")


def symbolic(n):
    """``n`` itself, or a new symbolic extent named ``n`` when it is a string."""
    return tirx.Var(n, "int64") if isinstance(n, str) else n


def kv_decoder(n) -> tvm.IRModule:
    """The layer in Relax operators, keys and values through a KV cache per layer."""
    n = symbolic(n)

    @I.ir_module
    class KVDecoder:
        I.module_attrs({"device_num": 2})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function(pure=False)
        def main(x: R.Tensor((n, 16), "float32"), cache: R.Tuple(R.Object, R.Object),
                 g: R.Tensor((16,), "float32"), wq: R.Tensor((16, 16), "float32"),
                 wk: R.Tensor((16, 16), "float32"), wv: R.Tensor((16, 16), "float32"),
                 wo: R.Tensor((16, 16), "float32")) -> R.Tensor((n, 16), "float32"):
            ms = R.mean(R.multiply(x, x), axis=[-1], keepdims=True)
            h = R.multiply(R.multiply(x, R.rsqrt(R.add(ms, R.const(1e-5, "float32")))), g)
            q = R.reshape(R.matmul(h, R.dist.annotate_sharding(wq, "mesh[0]", "S[1]")),
                          R.shape([n, 4, 4]))
            k = R.reshape(R.matmul(h, R.dist.annotate_sharding(wk, "mesh[0]", "S[1]")),
                          R.shape([n, 4, 4]))
            v = R.reshape(R.matmul(h, R.dist.annotate_sharding(wv, "mesh[0]", "S[1]")),
                          R.shape([n, 4, 4]))
            k_cache: R.Object = R.call_packed("vm.builtin.attention_kv_cache_append", cache[0],
                                              k, ty_args=(R.Object(),))
            v_cache: R.Object = R.call_packed("vm.builtin.attention_kv_cache_append", cache[1],
                                              v, ty_args=(R.Object(),))
            keys: R.Tensor((n, 4, 4), "float32") = R.call_packed(
                "vm.builtin.attention_kv_cache_view", k_cache, R.shape([n, 4, 4]),
                ty_args=(R.Tensor((n, 4, 4), "float32"),))
            values: R.Tensor((n, 4, 4), "float32") = R.call_packed(
                "vm.builtin.attention_kv_cache_view", v_cache, R.shape([n, 4, 4]),
                ty_args=(R.Tensor((n, 4, 4), "float32"),))
            scores = R.matmul(R.permute_dims(q, [1, 0, 2]), R.permute_dims(keys, [1, 2, 0]))
            probs = R.nn.softmax(R.multiply(scores, R.const(0.5, "float32")), axis=-1)
            mixed = R.permute_dims(R.matmul(probs, R.permute_dims(values, [1, 0, 2])), [1, 0, 2])
            out = R.add(x, R.matmul(R.reshape(mixed, R.shape([n, 16])), wo))
            return out

    return KVDecoder


def prefix_decoder(n, past: int) -> tvm.IRModule:
    """:func:`kv_decoder` whose caches start from given keys and values (a runnable form).

    The caches are created in the function (``vm.builtin.attention_kv_cache_create``)
    from ``past_k`` and ``past_v`` (``past`` positions each), so the function takes
    tensors only; the new keys and values are appended and the queries attend
    to all ``past + n`` positions.
    """
    n = symbolic(n)
    total = past + n

    @I.ir_module
    class PrefixDecoder:
        I.module_attrs({"device_num": 2})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function(pure=False)
        def main(x: R.Tensor((n, 16), "float32"), past_k: R.Tensor((past, 4, 4), "float32"),
                 past_v: R.Tensor((past, 4, 4), "float32"), g: R.Tensor((16,), "float32"),
                 wq: R.Tensor((16, 16), "float32"), wk: R.Tensor((16, 16), "float32"),
                 wv: R.Tensor((16, 16), "float32"), wo: R.Tensor((16, 16), "float32")
                 ) -> R.Tensor((n, 16), "float32"):
            ms = R.mean(R.multiply(x, x), axis=[-1], keepdims=True)
            h = R.multiply(R.multiply(x, R.rsqrt(R.add(ms, R.const(1e-5, "float32")))), g)
            q = R.reshape(R.matmul(h, R.dist.annotate_sharding(wq, "mesh[0]", "S[1]")),
                          R.shape([n, 4, 4]))
            k = R.reshape(R.matmul(h, R.dist.annotate_sharding(wk, "mesh[0]", "S[1]")),
                          R.shape([n, 4, 4]))
            v = R.reshape(R.matmul(h, R.dist.annotate_sharding(wv, "mesh[0]", "S[1]")),
                          R.shape([n, 4, 4]))
            k_empty: R.Object = R.call_packed("vm.builtin.attention_kv_cache_create", past_k,
                                              R.shape([total, 4, 4]), R.prim_value(-1),
                                              ty_args=(R.Object(),))
            v_empty: R.Object = R.call_packed("vm.builtin.attention_kv_cache_create", past_v,
                                              R.shape([total, 4, 4]), R.prim_value(-1),
                                              ty_args=(R.Object(),))
            k_cache: R.Object = R.call_packed("vm.builtin.attention_kv_cache_append", k_empty,
                                              k, ty_args=(R.Object(),))
            v_cache: R.Object = R.call_packed("vm.builtin.attention_kv_cache_append", v_empty,
                                              v, ty_args=(R.Object(),))
            keys: R.Tensor((total, 4, 4), "float32") = R.call_packed(
                "vm.builtin.attention_kv_cache_view", k_cache, R.shape([total, 4, 4]),
                ty_args=(R.Tensor((total, 4, 4), "float32"),))
            values: R.Tensor((total, 4, 4), "float32") = R.call_packed(
                "vm.builtin.attention_kv_cache_view", v_cache, R.shape([total, 4, 4]),
                ty_args=(R.Tensor((total, 4, 4), "float32"),))
            scores = R.matmul(R.permute_dims(q, [1, 0, 2]), R.permute_dims(keys, [1, 2, 0]))
            probs = R.nn.softmax(R.multiply(scores, R.const(0.5, "float32")), axis=-1)
            mixed = R.permute_dims(R.matmul(probs, R.permute_dims(values, [1, 0, 2])), [1, 0, 2])
            out = R.add(x, R.matmul(R.reshape(mixed, R.shape([n, 16])), wo))
            return out

    return PrefixDecoder


def plain_decoder(n) -> tvm.IRModule:
    """:func:`kv_decoder` without the cache: the keys and values are used directly."""
    n = symbolic(n)

    @I.ir_module
    class PlainDecoder:
        I.module_attrs({"device_num": 2})
        I.module_global_infos({"mesh": [R.dist.device_mesh((2,), I.Range(0, 2))]})

        @R.function
        def main(x: R.Tensor((n, 16), "float32"), g: R.Tensor((16,), "float32"),
                 wq: R.Tensor((16, 16), "float32"), wk: R.Tensor((16, 16), "float32"),
                 wv: R.Tensor((16, 16), "float32"), wo: R.Tensor((16, 16), "float32")
                 ) -> R.Tensor((n, 16), "float32"):
            ms = R.mean(R.multiply(x, x), axis=[-1], keepdims=True)
            h = R.multiply(R.multiply(x, R.rsqrt(R.add(ms, R.const(1e-5, "float32")))), g)
            q = R.reshape(R.matmul(h, R.dist.annotate_sharding(wq, "mesh[0]", "S[1]")),
                          R.shape([n, 4, 4]))
            k = R.reshape(R.matmul(h, R.dist.annotate_sharding(wk, "mesh[0]", "S[1]")),
                          R.shape([n, 4, 4]))
            v = R.reshape(R.matmul(h, R.dist.annotate_sharding(wv, "mesh[0]", "S[1]")),
                          R.shape([n, 4, 4]))
            scores = R.matmul(R.permute_dims(q, [1, 0, 2]), R.permute_dims(k, [1, 2, 0]))
            probs = R.nn.softmax(R.multiply(scores, R.const(0.5, "float32")), axis=-1)
            mixed = R.permute_dims(R.matmul(probs, R.permute_dims(v, [1, 0, 2])), [1, 0, 2])
            out = R.add(x, R.matmul(R.reshape(mixed, R.shape([n, 16])), wo))
            return out

    return PlainDecoder


def _kernels(n):
    """The hand-written TIR kernels: RMS norm over the hidden features, rotary embedding."""

    @T.prim_func(private=True, s_tir=True)
    def rms_norm(var_x: T.handle, g: T.Buffer((16,), "float32"), var_y: T.handle):
        x = T.match_buffer(var_x, (n, 16), "float32")
        y = T.match_buffer(var_y, (n, 16), "float32")
        sq = T.sblock_alloc_buffer((n,), "float32")
        for i, j in T.grid(n, 16):
            with T.sblock("sum_sq"):
                vi, vj = T.axis.remap("SR", [i, j])
                with T.init():
                    sq[vi] = T.float32(0)
                sq[vi] = sq[vi] + x[vi, vj] * x[vi, vj]
        for i, j in T.grid(n, 16):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * g[vj] / T.sqrt(sq[vi] * T.float32(1 / 16) + T.float32(1e-5))

    @T.prim_func(private=True, s_tir=True)
    def rotary(var_x: T.handle, cos: T.Buffer((32, 4), "float32"),
               sin: T.Buffer((32, 4), "float32"), start: T.int64, var_y: T.handle):
        x = T.match_buffer(var_x, (n, 4, 4), "float32")
        y = T.match_buffer(var_y, (n, 4, 4), "float32")
        for i, h, d in T.grid(n, 4, 4):
            with T.sblock("rotate"):
                vi, vh, vd = T.axis.remap("SSS", [i, h, d])
                y[vi, vh, vd] = cos[start + vi, vd] * x[vi, vh, vd] + sin[start + vi, vd] * T.Select(
                    vd < 2, x[vi, vh, vd + 2] * T.float32(-1), x[vi, vh, vd - 2])

    return rms_norm, rotary


def tir_decoder(n, cache: bool = True) -> tvm.IRModule:
    """The layer as ``call_tir`` to TIR functions (see the module documentation).

    The parameters: ``x``, ``mask`` (1 x n x n, a minimum taken with the
    scores), ``scale`` (4 x n x n, the scores are divided by it), with
    ``cache`` the two KV caches, the weights (projections as (out, in)), then
    ``cos`` and ``sin`` (``MAX_POS`` x 4 tables).
    """
    n = symbolic(n)
    rms_norm, rotary = _kernels(n)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 16), "float32"))
    caches = relax.Var("cache", relax.TupleType([relax.ObjectType(), relax.ObjectType()]))
    weights = {w: relax.Var(w, relax.TensorType((16,) if w == "g" else (16, 16), "float32"))
               for w in WEIGHTS}
    cos = relax.Var("cos", relax.TensorType((MAX_POS, 4), "float32"))
    sin = relax.Var("sin", relax.TensorType((MAX_POS, 4), "float32"))
    mask = relax.Var("mask", relax.TensorType((1, n, n), "float32"))
    scale = relax.Var("scale", relax.TensorType((4, n, n), "float32"))
    params = [x, mask, scale] + ([caches] if cache else []) + list(weights.values()) + [cos, sin]
    heads = relax.TensorType((n, 4, 4), "float32")
    with bb.function("main", params, pure=not cache):
        norm_gv = bb.add_func(rms_norm, "rms_norm")
        rope_gv = bb.add_func(rotary, "rotary")
        h = bb.emit(relax.call_tir(norm_gv, [x, weights["g"]], relax.TensorType((n, 16), "float32")))

        def project(name):
            # weights come as (out, in), transposed by a kernel before the annotation
            w = bb.emit(relax.op.distributed.annotate_sharding(
                bb.emit(relax.op.permute_dims(weights[name])), _mesh(),
                relax.distributed.Placement.from_text("S[1]")))
            return bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(h, w)), (n, 4, 4)))

        # the first position's index is a scalar argument of the kernel (0 here)
        start = tirx.IntImm("int64", 0)
        q = bb.emit(relax.call_tir(rope_gv, [project("wq"), cos, sin, start], heads))
        k = bb.emit(relax.call_tir(rope_gv, [project("wk"), cos, sin, start], heads))
        v = project("wv")
        if cache:
            seen = []
            for slot, value in enumerate((k, v)):
                held = bb.emit(relax.Call(
                    relax.ExternFunc("vm.builtin.attention_kv_cache_append"),
                    [bb.emit(relax.TupleGetItem(caches, slot)), value],
                    ty_args=[relax.ObjectType()]))
                seen.append(bb.emit(relax.Call(
                    relax.ExternFunc("vm.builtin.attention_kv_cache_view"),
                    [held, relax.ShapeExpr([n, 4, 4])], ty_args=[heads])))
            k, v = seen
        scores = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(q, [1, 0, 2])),
                                         bb.emit(relax.op.permute_dims(k, [1, 2, 0]))))
        scaled = bb.emit(relax.op.minimum(bb.emit(relax.op.divide(scores, scale)), mask))
        probs = bb.emit(relax.op.nn.softmax(scaled, axis=-1))
        mixed = bb.emit(relax.op.permute_dims(
            bb.emit(relax.op.matmul(probs, bb.emit(relax.op.permute_dims(v, [1, 0, 2])))),
            [1, 0, 2]))
        out = bb.emit(relax.op.add(x, bb.emit(relax.op.matmul(
            bb.emit(relax.op.reshape(mixed, (n, 16))), weights["wo"]))))
        bb.emit_func_output(out)
    mod = bb.get()
    mod = mod.with_attr("device_num", 2)
    mod.update_global_info("mesh", [_mesh()])
    return relax.transform.LegalizeOps()(mod)


def _mesh():
    return relax.distributed.DeviceMesh((2,), I.Range(0, 2))


# --------------------------------------------------------------------------- numpy
def random_inputs(n: int, seed: int = 0, past: int = 0) -> dict[str, np.ndarray]:
    """Random inputs by parameter name (no caches) for a sequence of ``n`` tokens.

    ``mask`` is causal (a position sees itself and those before it) and
    ``scale`` is 2 everywhere. With ``past``, ``past_k`` and ``past_v`` hold
    that many earlier positions (for :func:`prefix_decoder`).
    """
    rng = np.random.default_rng(seed)
    causal = np.tril(np.ones((n, n), dtype=bool))
    out = {"x": rng.standard_normal((n, HIDDEN), dtype=np.float32),
           "mask": np.where(causal, 1e9, -1e9).astype(np.float32)[None],
           "scale": np.full((HEADS, n, n), 2.0, dtype=np.float32),
           "g": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)}
    for w in WEIGHTS[1:]:
        out[w] = (0.3 * rng.standard_normal((HIDDEN, HIDDEN))).astype(np.float32)
    angles = np.arange(MAX_POS)[:, None] * np.array([1.0, 0.1, 1.0, 0.1])[None, :]
    out["cos"], out["sin"] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    if past:
        out["past_k"], out["past_v"] = (rng.standard_normal((past, HEADS, HEAD_DIM),
                                                            dtype=np.float32) for _ in range(2))
    return out


def reference(inputs: dict[str, np.ndarray], tir: bool) -> np.ndarray:
    """The layer in numpy (``tir``: as :func:`tir_decoder` computes it, else :func:`plain_decoder`).

    The projections of :func:`tir_decoder` are given as (out, in).
    """
    x, g = inputs["x"], inputs["g"]
    n = x.shape[0]
    h = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
    q, k, v = ((h @ (inputs[w].T if tir else inputs[w])).reshape(n, HEADS, HEAD_DIM)
               for w in ("wq", "wk", "wv"))
    if "past_k" in inputs:  # prefix_decoder: the cache holds the past, then the new
        k = np.concatenate([inputs["past_k"], k])
        v = np.concatenate([inputs["past_v"], v])
    if tir:
        cos, sin = inputs["cos"][:n, None, :], inputs["sin"][:n, None, :]

        def rope(t):
            return cos * t + sin * np.concatenate([-t[..., 2:], t[..., :2]], axis=-1)

        q, k = rope(q), rope(k)
    scores = np.einsum("ihd,jhd->hij", q, k)  # queries: the new positions only
    scores = np.minimum(scores / inputs["scale"], inputs["mask"]) if tir else scores * 0.5
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    mixed = np.einsum("hij,jhd->ihd", probs, v).reshape(n, HIDDEN)
    return x + mixed @ inputs["wo"]


def arguments(mod: tvm.IRModule, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``inputs`` in the order of ``main``'s parameters."""
    return [inputs[p.name] for p in mod["main"].params]
