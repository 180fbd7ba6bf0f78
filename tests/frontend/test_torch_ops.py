"""PyTorch operators TVM's frontend lacks or mistranslates, each imported and run against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_distx as td
from tvm_distx import ShardingRule
from tvm_distx.compiler.pipeline import legalize_operators
from tvm_distx.frontend.pytorch import from_torch
from tvm_distx.frontend.torch_ops import CONVERTERS
from tvm_distx.passes import AnnotateSharding
from tvm_distx.plans.presets import set_device_meshes


def run_like_torch(module: torch.nn.Module, *inputs: torch.Tensor, atol: float = 1e-5) -> None:
    """Import ``module``, run it on 2 emulated ranks and compare with torch."""
    module = module.eval()
    with torch.no_grad():
        want = module(*inputs).numpy()
    mod, weights = from_torch(module, inputs)
    replicated = [ShardingRule(param=p.name, result="R") for p in mod["main"].params
                  if p.name not in weights]
    exe = td.compile(AnnotateSharding(replicated)(set_device_meshes(mod, [(2,)])))
    got = exe.run(*[x.numpy() for x in inputs], params=weights, backend="emulate")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol)


def test_numpy_style_transpose_of_a_weight():
    """``weight.T`` (Falcon's linear): ``numpy_T`` reverses every axis."""
    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(24, 16))

        def forward(self, x):
            return x @ self.weight.T

    torch.manual_seed(0)
    run_like_torch(Linear(), torch.randn(3, 16))


@pytest.mark.parametrize("affine, bias", [(False, False), (True, False), (True, True)])
def test_layer_norm_without_weight_or_bias(affine, bias):
    """OLMo's norm has neither a weight nor a bias; others drop only the bias."""
    torch.manual_seed(1)
    norm = torch.nn.LayerNorm(32, eps=1e-6, elementwise_affine=affine, bias=bias)
    if affine:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
    run_like_torch(norm, torch.randn(2, 5, 32))


@pytest.mark.parametrize("index", [[-2], [0, -1], [3]])
def test_a_list_index_counts_negative_entries_from_the_end(index):
    """Falcon's ``fused_qkv[..., [-2], :]``: TVM's take would read out of bounds."""
    class Pick(torch.nn.Module):
        def forward(self, x):
            return x.view(1, 3, 6, 4)[..., index, :] * 2.0

    torch.manual_seed(2)
    run_like_torch(Pick(), torch.randn(1, 3, 24))
    # the list is a constant of the program, counted from the end at import: later passes
    # read it (a fused projection is cut by the heads it picks)
    mod, _ = td.from_torch(Pick(), (torch.randn(1, 3, 24),))
    takes = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: takes.append(e) if (
        isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.take") else None)
    assert len(takes) == 1 and isinstance(takes[0].args[1], tvm.ir.Constant)
    np.testing.assert_array_equal(takes[0].args[1].value.numpy(), np.array(index) % 6)


def _ops(mod) -> set[str]:
    names = set()
    relax.analysis.post_order_visit(mod["main"].body, lambda e: names.add(e.op.name) if (
        isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op)) else None)
    return names


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("keep", [True, False])
def test_max_and_min_along_an_axis_are_reductions(largest, keep):
    """GPT-OSS's ``scores.max(dim=-1, keepdim=True).values``: a reduction that sharding sees
    through (TVM's ``topk`` of one gathered the scores of every head)."""
    class Extreme(torch.nn.Module):
        def forward(self, x):
            found = x.max(dim=-1, keepdim=keep) if largest else x.min(dim=2, keepdim=keep)
            return x.sum(-1, keepdim=keep) - found.values

    x = torch.randn(2, 3, 5)
    run_like_torch(Extreme(), x)
    ops = _ops(td.from_torch(Extreme(), (x,))[0])
    assert "relax.topk" not in ops and not {"relax.argmax", "relax.argmin"} & ops
    assert ("relax.max" if largest else "relax.min") in ops


def test_the_indices_of_max_along_an_axis_are_computed_when_read():
    class Both(torch.nn.Module):
        def forward(self, x):
            values, indices = x.max(dim=1)
            return values * indices.to(x.dtype)

    x = torch.randn(4, 6)
    run_like_torch(Both(), x)
    assert "relax.argmax" in _ops(td.from_torch(Both(), (x,))[0])


def test_an_operator_the_frontend_cannot_translate_is_named(monkeypatch):
    """The error names the ATen operator and its node, not only TVM's exception.

    TVM's own ``layer_norm`` translation (ours removed) fails on a norm without
    weight or bias with a bare ``KeyError: None``.
    """
    monkeypatch.delitem(CONVERTERS, "layer_norm.default")
    norm = torch.nn.LayerNorm(8, elementwise_affine=False)
    with pytest.raises(td.errors.UnsupportedProgramError,
                       match=r"cannot translate LayerNorm at operator aten\.layer_norm\.default "
                             r"\(node 'layer_norm'\): KeyError"):
        from_torch(norm, (torch.randn(2, 8),))


def test_complex_rotary_as_real_pairs():
    """Llama 4's rotary embedding: polar, view_as_complex, a complex product, view_as_real."""
    class Rotary(torch.nn.Module):
        def forward(self, x, angles):
            freqs = torch.polar(torch.ones_like(angles), angles) * 0.5  # (seq, 4)
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * freqs[:, None, :]).flatten(2)

    torch.manual_seed(3)
    run_like_torch(Rotary(), torch.randn(5, 2, 8), torch.randn(5, 4))


@pytest.mark.parametrize("value", [float("-inf"), float("inf")])
def test_a_fill_of_an_infinite_value(value):
    """Llama 4's router: ``full_like(logits, -inf).scatter(top-k)``; masks fill with -inf too.

    TVM's legalization of ``full``/``full_like`` fails on a non-finite value
    (``argument of type 'PrimType' is not iterable``).
    """
    class Router(torch.nn.Module):
        def forward(self, logits):
            top, index = torch.topk(logits, 2, dim=1)
            scores = torch.full_like(logits, value).scatter(1, index, top)
            mask = torch.full((logits.shape[0], 1), value)
            return torch.sigmoid(scores) + torch.exp(-torch.abs(mask))

    torch.manual_seed(4)
    run_like_torch(Router(), torch.randn(6, 4))


def test_a_fill_of_an_infinite_value_over_a_symbolic_extent():
    """The fill of a run-time token count legalizes to one kernel over that count."""
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 4), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            out = builder.emit_output(relax.op.full_like(x, relax.const(float("-inf"))))
        builder.emit_func_output(out)
    legalized = legalize_operators(builder.get(), fuse=False)
    kernels = [f for f in legalized.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 1
    exe = tvm.compile(legalized, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(np.zeros((3, 4), "float32"))).numpy()
    np.testing.assert_array_equal(got, np.full((3, 4), -np.inf, "float32"))
