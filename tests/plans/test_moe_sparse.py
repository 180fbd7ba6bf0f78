"""The sparse expert dispatch: a rank computes only the (token, expert) pairs routed to its
experts, and its results equal the dense formula and transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from tvm_distx.compiler.schedule.experts import (EXPERTS_ATTR, ExpertsKernel, experts_definition,
                                        sparse_experts)

HIDDEN, INTER, EXPERTS = 16, 12, 4


def _build(func: tvm.tirx.PrimFunc):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                       target="llvm")["main"]


def _reference(x, routing, w_up, w_down, kernel: ExpertsKernel):
    """The dense formula of tvm_distx.compiler.schedule.experts, in numpy (float64)."""
    up = w_up.transpose(0, 2, 1) if kernel.up_transposed else w_up         # (E, 2I, H)
    down = w_down.transpose(0, 2, 1) if kernel.down_transposed else w_down  # (E, H, I)
    h = np.einsum("th,ejh->etj", x.astype(np.float64), up)
    gate, lin = h[..., :kernel.intermediate], h[..., kernel.intermediate:]
    y = np.einsum("eti,edi->etd", gate / (1 + np.exp(-gate)) * lin, down)
    return np.einsum("te,etd->td", routing, y)


def _operands(kernel: ExpertsKernel, routing: np.ndarray, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((routing.shape[0], HIDDEN)).astype("float32")
    w_up = (rng.standard_normal(kernel.up_shape) / 4).astype("float32")
    w_down = (rng.standard_normal(kernel.down_shape) / 4).astype("float32")
    return x, routing.astype("float32"), w_up, w_down


def _run(fn, operands, tokens: int, count: bool):
    args = [tvm.runtime.tensor(a) for a in operands]
    args.append(tvm.runtime.tensor(np.full((tokens, HIDDEN), np.nan, "float32")))
    if count:
        args.append(tvm.runtime.tensor(np.full(tokens, -1, "int32")))
    fn(*args)
    return [a.numpy() for a in args[len(operands):]]


@pytest.fixture(scope="module", params=[(False, False), (True, True)],
                ids=["stored (E, out, in)", "stored (E, in, out)"])
def kernels(request):
    kernel = ExpertsKernel(EXPERTS, HIDDEN, INTER, up_transposed=request.param[0],
                           down_transposed=request.param[1])
    return kernel, _build(sparse_experts(kernel, count=True)), _build(experts_definition(kernel))


def _top_k_routing(tokens: int, k: int, seed: int) -> np.ndarray:
    """A softmax-then-top-k routing matrix over EXPERTS experts (zero off the top k)."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((tokens, EXPERTS))
    chosen = np.argsort(-scores, axis=1)[:, :k]
    routing = np.zeros((tokens, EXPERTS))
    weights = np.exp(np.take_along_axis(scores, chosen, 1))
    np.put_along_axis(routing, chosen, weights / weights.sum(1, keepdims=True), 1)
    return routing


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_the_sparse_kernel_equals_the_dense_formula_and_counts_only_routed_pairs(kernels,
                                                                                tokens):
    kernel, sparse, dense = kernels
    routing = _top_k_routing(tokens, 2, seed=tokens)
    routing[0] = 0  # a token routed to none of these (this rank's) experts
    operands = _operands(kernel, routing)
    out, evaluations = _run(sparse, operands, tokens, count=True)
    want = _reference(*operands, kernel)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
    # one expert MLP per routed (token, expert) pair, none for the others
    np.testing.assert_array_equal(evaluations, (routing != 0).sum(axis=1))
    assert evaluations.sum() == 2 * (tokens - 1) < tokens * EXPERTS
    # the definition (what propagation reads) computes the same values densely
    (defined,) = _run(dense, operands, tokens, count=False)
    np.testing.assert_allclose(defined, out, atol=1e-5, rtol=0)


def test_an_expert_no_token_is_routed_to_is_never_read(kernels):
    kernel, sparse, _ = kernels
    routing = _top_k_routing(9, 2, seed=3)
    routing[:, 1] = 0  # nobody goes to expert 1 ...
    x, routing, w_up, w_down = _operands(kernel, routing)
    want = _reference(x, routing, w_up, w_down, kernel)
    w_up[1], w_down[1] = np.nan, np.nan  # ... so its weights may be anything
    out, _ = _run(sparse, (x, routing, w_up, w_down), 9, count=True)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
    # a rank none of whose experts receives a token: zeros, and no expert MLP at all
    x, routing, w_up, w_down = _operands(kernel, np.zeros((5, EXPERTS)))
    out, evaluations = _run(sparse, (x, routing, np.full_like(w_up, np.nan),
                                     np.full_like(w_down, np.nan)), 5, count=True)
    np.testing.assert_array_equal(out, np.zeros((5, HIDDEN), "float32"))
    np.testing.assert_array_equal(evaluations, np.zeros(5, "int32"))


def test_both_forms_describe_the_same_kernel():
    kernel = ExpertsKernel(EXPERTS, HIDDEN, INTER, up_transposed=True)
    for func in (experts_definition(kernel), sparse_experts(kernel)):
        assert ExpertsKernel.of(func) == kernel
        assert EXPERTS_ATTR in func.attrs
    assert ExpertsKernel.of(sparse_experts(kernel).with_attr(EXPERTS_ATTR, None)) is None


# ----------------------------------------------------------------- a whole MoE layer, 2 ranks
torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")


def test_expert_parallel_never_touches_unrouted_experts_on_two_mpi_ranks():
    """Mixtral's sparse block, 8 experts, top-2, 3 tokens: at least 2 experts get no
    token. Their weights are set to NaN, in transformers' model and in ours: transformers
    (which loops over the experts hit) stays finite, and so must we; the masked dense
    dispatch would give NaN (0 * NaN)."""
    import tvm_distx as td
    from tvm_distx.plans import moe
    from tvm_distx.plans.moe_dispatch import experts_calls
    from tvm_distx.compiler.pipeline import run_stages
    from tvm_distx.plans.presets import set_device_meshes

    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48,
                              num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2, num_local_experts=8,
                              num_experts_per_tok=2, max_position_embeddings=64)
    block = tf.MixtralForCausalLM(config).eval().model.layers[0].mlp
    x = torch.randn(1, 3, 32)
    mod, weights = td.from_torch(block, (x,))
    with torch.no_grad():
        _, _, chosen = block.gate(x.reshape(-1, 32))  # the router: logits, weights, indices
    hit = set(chosen.flatten().tolist())
    unrouted = sorted(set(range(8)) - hit)
    assert len(unrouted) >= 2
    for name in ("p_experts_gate_up_proj", "p_experts_down_proj"):
        weights[name][unrouted] = np.nan
        with torch.no_grad():
            getattr(block.experts, name[len("p_experts_"):])[unrouted] = float("nan")
    with torch.no_grad():
        want = block(x)
    want = (want[0] if isinstance(want, tuple) else want).numpy()
    assert np.isfinite(want).all()

    annotated = moe.expert_parallel().apply(set_device_meshes(mod, [(2,)]))
    (_, _, kernel), = experts_calls(annotated)
    assert kernel == ExpertsKernel(8, 32, 48)
    rows = [r for r in td.comm_report(run_stages(annotated)["local_view"]).rows
            if r.collective != "local_slice"]
    assert [r.collective for r in rows] == ["all_reduce"]  # one per MoE layer, as before
    exe = td.compile(annotated)
    local = [ExpertsKernel.of(f) for f in exe.built.functions.values()
             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
             and EXPERTS_ATTR in f.attrs and "tirx.is_scheduled" in f.attrs]
    assert ExpertsKernel(4, 32, 48) in local  # each rank: a sparse kernel over its 4 experts
    out = exe.run(x.numpy(), params=weights, backend="mpi")
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=0)
