"""Token generation with the key-value cache as sharded state (export_decoder).

Greedy generation by repeated one-shot runs (prefill once, then decode step by
step, the returned caches fed back in) must give transformers' own
``generate(do_sample=False)`` tokens, token for token, on MPI ranks, and so must
a session that keeps the caches on the ranks between calls; the caches
must be split by heads like the attention that writes them, and decode must
move nothing but one all-reduce per attention block and per MLP.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.plans import presets  # noqa: E402
from tvm_distx.errors import ArgumentError, UnsupportedProgramError  # noqa: E402
from tvm_distx.layout import Replicate, Shard  # noqa: E402
from tvm_distx.compiler.pipeline import run_stages  # noqa: E402
from tvm_distx.runtime.backends import launch  # noqa: E402
from tvm_distx.bundle.signature import FunctionSignature  # noqa: E402

from hf_tiny import VOCAB, build, tokens as random_ids  # noqa: E402

MAX_LENGTH = 32
NEW_TOKENS = 16


def _gpt2():
    """A tiny GPT-2 whose random weights are large enough for the tokens to vary."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64, initializer_range=0.3,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _annotated(mod, ranks: int):
    preset = presets.tensor_parallel()
    annotated = presets.set_device_meshes(mod, [(ranks,)])
    for function in ("prefill", "decode"):
        annotated = preset.apply(annotated, function)
    return annotated


def _compiled(model, ranks: int, prompt_length: int | None = None):
    mod, weights, cache = td.export_decoder(model, max_length=MAX_LENGTH,
                                            prompt_length=prompt_length)
    annotated = _annotated(mod, ranks)
    return {"model": model, "mod": mod, "annotated": annotated, "exe": td.compile(annotated),
            "weights": weights, "cache": cache}


@pytest.fixture(scope="module")
def llama2():
    return _compiled(build("llama"), 2)


@pytest.fixture(scope="module")
def gpt2_2():
    return _compiled(_gpt2(), 2)


@pytest.fixture(scope="module")
def gpt2_4():
    return _compiled(_gpt2(), 4)


def _generate(case, prompt: np.ndarray, new_tokens: int, bundle: Path | None = None,
              backend: str = "mpi"):
    """Greedy tokens by one one-shot run per step, and the prefill's logits.

    Each step is ``exe.run`` (which writes a bundle and launches the ranks). With
    ``bundle`` (a bundle of ``decode`` written once, weights included), each decode
    step is one launch of it, as ``tvm-distx run`` does: the same ranks' programs,
    without relinking the library and rewriting the weights every token.
    """
    exe, weights, cache = case["exe"], case["weights"], case["cache"]

    def run(function, *inputs):
        if bundle is None or function != "decode":
            return exe.run(*inputs, params=weights, function=function, backend=backend)
        return launch(bundle, list(inputs), function=function)

    length = prompt.shape[1]
    logits, *state = run("prefill", prompt, np.arange(length), *cache.zeros())
    prefill_logits = logits
    tokens = [int(logits[0, -1].argmax())]
    for step in range(new_tokens - 1):
        logits, *state = run("decode", np.array([[tokens[-1]]]), np.array([length + step]),
                             *state)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens, prefill_logits


def _generate_in_session(case, prompt: np.ndarray, new_tokens: int) -> list[int]:
    """Greedy tokens on ranks launched once, the caches kept on them between calls.

    Result ``i + 1`` of both functions is the new value of cache parameter ``i``
    (:class:`tvm_distx.frontend.decoder.KVCacheLayout`): each rank keeps its shard of
    it, and the next call takes it from there; only the logits come back.
    """
    exe, weights, cache = case["exe"], case["weights"], case["cache"]
    state = {name: name for name in cache.names}  # absent before the prompt: zeros
    keep = {index + 1: name for index, name in enumerate(cache.names)}
    length = prompt.shape[1]
    with exe.session(params=weights, function=("prefill", "decode")) as session:
        (logits,) = session.run(prompt, np.arange(length), function="prefill",
                                state=state, keep=keep)
        tokens = [int(logits[0, -1].argmax())]
        for step in range(new_tokens - 1):
            (logits,) = session.run(np.array([[tokens[-1]]]), np.array([length + step]),
                                    function="decode", state=state, keep=keep)
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


def _bundle(case, directory: Path) -> Path:
    """The program written once, with the decode's weights (prefill takes the same)."""
    return case["exe"].export(directory / "bundle", params=case["weights"], function="decode")


def _transformers_tokens(model, prompt: np.ndarray, new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.from_numpy(prompt), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _collectives(annotated, function: str) -> list[str]:
    rows = td.comm_report(run_stages(annotated)["local_view"]).rows
    return [r.collective for r in rows if r.function == function and
            r.collective != "local_slice"]


def _cache_specs(exe, cache):
    specs = {p.name: p for p in exe.signatures["decode"].params}
    return [specs[name] for name in cache.names]


# ------------------------------------------------------------------------- tokens
def test_one_shot_runs_give_transformers_logits_and_tokens(llama2, tmp_path):
    """Without a session: each step is one launch (prefill through exe.run, decode steps
    through a bundle written once). Three steps; the sessions below generate the rest."""
    prompt = random_ids(6, seed=1)
    tokens, prefill_logits = _generate(llama2, prompt, 3, bundle=_bundle(llama2, tmp_path))
    assert tokens == _transformers_tokens(llama2["model"], prompt, 3)
    with torch.no_grad():
        want = llama2["model"](torch.from_numpy(prompt), use_cache=False).logits.numpy()[:, -1:]
    np.testing.assert_allclose(prefill_logits, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["llama2", "gpt2_2", "gpt2_4"])
def test_a_session_keeps_the_cache_on_the_ranks_and_generates_the_same_tokens(case, request):
    case = request.getfixturevalue(case)
    prompt = random_ids(7, seed=3)
    tokens = _generate_in_session(case, prompt, 24)
    assert tokens == _transformers_tokens(case["model"], prompt, 24)


# ------------------------------------------------------------------ the sharded cache
@pytest.mark.parametrize("case, ranks", [("llama2", 2), ("gpt2_4", 4)])
def test_the_cache_is_split_by_heads_one_pth_per_rank(case, ranks, request):
    case = request.getfixturevalue(case)
    exe, cache = case["exe"], case["cache"]
    for spec, shape in zip(_cache_specs(exe, cache), cache.shapes):
        assert spec.shape == shape
        assert spec.sharding.placement.entries == (Shard(1),)  # the heads
        batch, heads, length, head_dim = shape
        assert spec.local_shape == (batch, heads // ranks, length, head_dim)
    # prefill takes and returns the caches split the same way (no move between the two)
    prefill = {p.name: p for p in exe.signatures["prefill"].params}
    assert all(prefill[s.name].sharding == s.sharding for s in _cache_specs(exe, cache))


@pytest.mark.parametrize("case, blocks, lookups", [("llama2", 4, 1), ("gpt2_2", 4, 2),
                                                    ("gpt2_4", 4, 2)])
def test_decode_moves_only_one_all_reduce_per_block(case, blocks, lookups, request):
    case = request.getfixturevalue(case)
    # two layers: one attention block and one MLP each, after the embeddings' lookups, split
    # on their rows (GPT-2's token table with its tied head, and its position table, whose
    # positions are an input here): one all-reduce each in the prefill; in the decode step
    # GPT-2's two partial sums are added before one all-reduce completes both. The logits
    # are split on the vocabulary, gathered when the result is assembled
    assert _collectives(case["annotated"], "decode") == ["all_reduce"] * (blocks + 1)
    assert _collectives(case["annotated"], "prefill") == ["all_reduce"] * (blocks + lookups)


def test_fewer_kv_heads_than_ranks_keep_the_cache_whole_where_kv_projections_are_whole(llama2):
    mod, cache = llama2["mod"], llama2["cache"]
    plan = presets.tensor_parallel().plan(presets.set_device_meshes(mod, [(4,)]), "decode")
    kv = [r for r in plan.roles if "k_proj" in r.param or "v_proj" in r.param]
    assert len(kv) == 4 and all(r.axis is None for r in kv)  # 2 key/value heads, 4 ranks
    stages = run_stages(_annotated(mod, 4))
    decode = FunctionSignature.from_function("decode", stages["propagate_sharding"]["decode"])
    specs = {p.name: p for p in decode.params}
    for name, shape in zip(cache.names, cache.shapes):
        assert specs[name].sharding.placement.entries == (Replicate(),)
        assert specs[name].local_shape == shape
    rows = td.comm_report(stages["local_view"]).rows
    assert [r.collective for r in rows if r.function == "decode" and
            r.collective != "local_slice"] == ["all_reduce"] * 5  # the lookup's, then 4 blocks


# --------------------------------------------------------------------------- errors
def test_export_decoder_refuses_bad_lengths_and_models_without_a_cache():
    with pytest.raises(ArgumentError, match="max_length"):
        td.export_decoder(build("llama", layers=1), max_length=1)
    with pytest.raises(ArgumentError, match="use_cache"):
        td.export_decoder(torch.nn.Linear(4, 4), max_length=8)


def test_the_layout_gives_empty_caches_and_their_size(llama2):
    cache = llama2["cache"]
    zeros = cache.zeros()
    assert [z.shape for z in zeros] == list(cache.shapes) and not any(z.any() for z in zeros)
    assert cache.nbytes() == sum(z.nbytes for z in zeros)
    assert cache.names[:2] == ("key_0", "value_0") and len(cache.names) == 4
    assert _cache_specs(llama2["exe"], cache)[0].sharding.placement.entries != (Replicate(),)


def test_a_public_function_left_unannotated_lowers_as_it_is(llama2):
    # prefill split, decode not annotated at all: decode runs whole on every rank
    annotated = presets.tensor_parallel().apply(presets.set_device_meshes(llama2["mod"], [(2,)]),
                                                "prefill")
    lowered = run_stages(annotated)["lower_distir"]
    decode = lowered["decode"]
    assert [tuple(int(d) for d in p.ty.shape) for p in decode.params[2:6]] == \
        list(llama2["cache"].shapes)
    assert "tvm_distx.ccl" not in decode.script() and "tvm_distx.ccl" in \
        lowered["prefill"].script()


def test_a_prefill_that_imports_only_for_a_fixed_length_says_how_to_fix_it():
    """DeepSeek-V3's experts translate for a fixed prompt length only: the error says so."""
    model = build("deepseek_v3", layers=1)
    with pytest.raises(UnsupportedProgramError) as err:
        td.export_decoder(model, max_length=16)
    assert "it translates for a fixed prompt length" in str(err.value)
    assert err.value.hint.startswith("fix the prompt length: CausalLM.from_hf(model, "
                                     "prompt_length=N)")
    mod = td.export_decoder(model, max_length=16, prompt_length=4).mod  # the fix works
    assert {"prefill", "decode"} <= {gv.name_hint for gv in mod.functions}


def test_the_decode_step_is_the_prefill_of_one_token_traced_once(monkeypatch):
    """One torch.export for both functions when the prompt length is symbolic; a prefill of
    a fixed length, or one torch proved only size-obliviously, leaves the decode traced."""
    from tvm import relax
    from tvm_distx.frontend import decoder

    exports = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export",
                        lambda *args, **kwargs: exports.append(1) or real(*args, **kwargs))
    program = td.export_decoder(build("llama"), max_length=MAX_LENGTH, with_weights=False)
    assert len(exports) == 1
    decode = program.mod["decode"]
    assert [tuple(int(d) for d in p.ty.shape) for p in decode.params[:2]] == [(1, 1), (1,)]
    assert not relax.analysis.defined_symbolic_vars(decode)
    assert not {p for p in decode.params} & {p for p in program.mod["prefill"].params}

    exports.clear()
    td.export_decoder(build("llama"), max_length=MAX_LENGTH, prompt_length=4, with_weights=False)
    assert len(exports) == 2
    assert decoder._decode_of((program.mod, {}, False)) is None
