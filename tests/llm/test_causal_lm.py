"""CausalLM: greedy generation on persistent MPI ranks equals transformers' generate.

One session per model: the prefill runs once per prompt and each new token is one
decode call; the caches stay on the ranks. Tokens must equal
``model.generate(do_sample=False)`` token for token, for one prompt, for two
prompts of different lengths, and through ``stream``. With ``max_batch=`` a batch
of prompts of different lengths is one left-padded prefill and one decode per
step, and its tokens equal transformers' ``generate`` of the same padded batch
(Llama with grouped-query attention, GPT-2 with learned positions). The command
line serves the same tokens on every backend.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.generation.sampling import Sampling  # noqa: E402

from hf_tiny import build, greedy, greedy_batch, prompt_ids  # noqa: E402

NEW_TOKENS = 12
#: prompts of different lengths for the batches
BATCH = [prompt_ids(3, seed=2), prompt_ids(7, seed=3), prompt_ids(5, seed=4)]


@pytest.fixture(scope="module")
def llama():
    model = build("llama")
    with CausalLM.from_hf(model, num_ranks=2, max_length=32, max_batch=3) as lm:
        yield model, lm


@pytest.fixture(scope="module")
def gpt2():
    model = build("gpt2", layers=1, init=0.5)
    with CausalLM.from_hf(model, num_ranks=2, max_length=16, max_batch=3) as lm:
        yield model, lm


def _calls(lm, monkeypatch) -> list[str]:
    """The functions the session runs from now on, in order."""
    called, run = [], lm.session.run

    def counted(*args, function="main", **kwargs):
        called.append(function)
        return run(*args, function=function, **kwargs)

    monkeypatch.setattr(lm.session, "run", counted)
    return called


def test_generate_equals_transformers_token_for_token(llama):
    model, lm = llama
    prompt = prompt_ids(5, seed=1)
    out = lm.generate(prompt[None, :], max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(out[0], greedy(model, prompt, NEW_TOKENS))
    assert out.shape == (1, 5 + NEW_TOKENS)
    assert lm.stats.new_tokens == NEW_TOKENS - 1 and lm.stats.decode_tokens_per_second > 0
    assert lm.stats.bytes_per_token > 0  # the all-reduces of the split blocks


def test_a_cold_start_lowers_once_and_counts_its_bytes_from_that_lowering(monkeypatch):
    """The comm report of a model (its bytes per token) comes from its compile's own local
    view: the stages run once per compile, and the report is the one a separate run of
    the stages gives."""
    from tvm_distx.compiler import pipeline

    runs, run_stages = [], pipeline.run_stages

    def counted(mod, **kwargs):
        runs.append(sorted(gv.name_hint for gv, f in mod.functions.items()
                           if f.attrs is not None and "global_symbol" in f.attrs))
        return run_stages(mod, **kwargs)

    monkeypatch.setattr(pipeline, "run_stages", counted)
    model = build("llama", layers=1)
    with CausalLM.from_hf(model, num_ranks=2, backend="emulate", max_length=12) as lm:
        assert runs == [["decode", "prefill"]]  # the compile's, and no other
        rows = td.comm_report(run_stages(lm.annotated)["local_view"]).rows
        assert td.comm_report(lm.exe.local_view).rows == rows
        decode = [r for r in rows if r.function == "decode"]
        # an all-reduce of the hidden state (64 floats) after the vocabulary-parallel
        # embedding, the attention and the MLP
        assert [(r.collective, r.bytes_per_rank) for r in decode
                if r.collective != "local_slice"] == [("all_reduce", 256)] * 3
        assert lm.stats.bytes_per_token == sum(r.bytes_per_rank for r in decode)
        np.testing.assert_array_equal(lm.generate(prompt_ids(4, seed=1), 4)[0],
                                      greedy(model, prompt_ids(4, seed=1), 4))


def test_prompts_of_different_lengths_and_the_stream_without_batched_functions(llama):
    model, llama_lm = llama
    lm = CausalLM(llama_lm.cache, llama_lm.session)  # no batch_cache: one prompt at a time
    pids = [p.pid for p in lm.session.ranks]
    calls = lm.session.calls
    prompts = [prompt_ids(3, seed=2), prompt_ids(7, seed=3)]
    rows = lm.generate(prompts, max_new_tokens=6)
    for prompt, row in zip(prompts, rows):
        np.testing.assert_array_equal(row, greedy(model, prompt, 6))
    streamed = list(lm.stream(prompts[1], max_new_tokens=6))
    np.testing.assert_array_equal(streamed, rows[1][7:])
    # the same ranks served every call: one prefill and five decodes per prompt
    assert [p.pid for p in lm.session.ranks] == pids
    assert lm.session.calls == calls + 3 * 6


@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_a_prompt_longer_than_a_chunk_is_prefilled_chunk_by_chunk_with_the_same_tokens(
        llama, chunk, monkeypatch):
    model, llama_lm = llama
    lm = CausalLM(llama_lm.cache, llama_lm.session, prefill_chunk=chunk)
    called, run = [], lm.session.run

    def noted(ids, positions, *args, function="main", **kwargs):
        called.append((function, np.asarray(positions).tolist()))
        return run(ids, positions, *args, function=function, **kwargs)

    monkeypatch.setattr(lm.session, "run", noted)
    prompt = prompt_ids(11, seed=5)
    out = lm.generate(prompt[None, :], max_new_tokens=4)
    np.testing.assert_array_equal(out[0], greedy(model, prompt, 4))
    prefills = [positions for function, positions in called if function == "prefill"]
    assert prefills == [list(range(b, min(b + chunk, 11))) for b in range(0, 11, chunk)]
    assert [function for function, _ in called[len(prefills):]] == ["decode"] * 3


def test_a_bad_prefill_chunk_is_refused_with_a_hint(llama):
    with pytest.raises(td.errors.ArgumentError, match=r"prefill_chunk=0.*\n.*hint: prefill_chunk=512"):
        CausalLM(llama[1].cache, llama[1].session, prefill_chunk=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("size", [2, 3])
def test_a_batch_is_one_prefill_and_one_decode_per_step_with_transformers_tokens(
        family, size, request, monkeypatch):
    model, lm = request.getfixturevalue(family)
    prompts = BATCH[:size]
    called = _calls(lm, monkeypatch)
    rows = lm.generate(prompts, max_new_tokens=8)
    assert called == ["prefill_batch"] + ["decode_batch"] * 7
    for prompt, row, want in zip(prompts, rows, greedy_batch(model, prompts, 8)):
        np.testing.assert_array_equal(row[:len(prompt)], prompt)
        np.testing.assert_array_equal(row[len(prompt):], want)  # the padded batch's tokens
        np.testing.assert_array_equal(row, greedy(model, prompt, 8))  # and each one's alone
    assert lm.stats.new_tokens == 7 * size and lm.stats.prefill_seconds > 0


def test_left_padding_gives_transformers_positions_and_a_mask_over_the_whole_cache():
    from tvm_distx.generation.batch import left_padded

    ids, positions, mask = left_padded([np.array([5, 6]), np.array([7, 8, 9])], batch=3,
                                       max_length=6, pad_token_id=0, length=4)
    np.testing.assert_array_equal(ids, [[0, 0, 5, 6], [0, 7, 8, 9], [0, 7, 8, 9]])  # filler
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1],
                                         [0, 1, 1, 1, 1, 1]])
    # transformers: cumsum(attention_mask) - 1, and 0 on the padding
    np.testing.assert_array_equal(positions, [[0, 0, 0, 1], [0, 0, 1, 2], [0, 0, 1, 2]])


def test_rows_of_a_batch_stop_at_their_end_token_and_big_batches_run_in_chunks(
        gpt2, monkeypatch):
    model, lm = gpt2
    alone = [greedy(model, p, 6)[len(p):] for p in BATCH]
    eos = int(alone[0][1])  # the first row ends at its second token
    called = _calls(lm, monkeypatch)
    rows = lm.generate(BATCH + BATCH[:1], max_new_tokens=6, eos_token_id=eos)
    want = greedy_batch(model, BATCH, 6, eos_token_id=eos)
    assert len(want[0]) == 2 and all(len(w) == 6 for w in want[1:])
    # 3 prompts, of which two run 6 tokens; then the fourth alone, ended at its second
    assert called == ["prefill_batch"] + ["decode_batch"] * 5 + ["prefill_batch", "decode_batch"]
    for prompt, row, expected in zip(BATCH + BATCH[:1], rows, want + want[:1]):
        np.testing.assert_array_equal(row[len(prompt):], expected)


def test_a_model_whose_masks_do_not_export_falls_back_to_one_prompt_at_a_time(caplog):
    import transformers

    class NoPadding(transformers.LlamaForCausalLM):
        def forward(self, *args, attention_mask=None, **kwargs):
            if attention_mask is not None:
                raise NotImplementedError("NoPadding takes no attention_mask")
            return super().forward(*args, **kwargs)

    model = NoPadding(build("llama", layers=1).config).eval()
    with caplog.at_level("WARNING", logger="tvm_distx.frontend.decoder"):
        program = td.export_decoder(model, max_length=16, max_batch=2)
    assert program.batch_cache is None
    assert {gv.name_hint for gv in program.mod.functions} >= {"prefill", "decode"}
    assert "prefill_batch" not in {gv.name_hint for gv in program.mod.functions}
    assert "no batched prefill and decode" in caplog.text and "one prompt after another" \
        in caplog.text


def test_batched_functions_that_do_not_shard_fall_back_to_the_batch_1_ones(
        caplog, monkeypatch):
    """A plan that refuses the batched functions: the batch-1 ones are compiled alone.

    The compile is stopped where it starts, to keep the test fast: what matters is
    the module it is given.
    """
    from tvm_distx.plans import presets

    class NoBatches:
        def apply(self, mod, function):
            if function.endswith("_batch"):
                raise td.errors.RuleError(f"NoBatches does not shard {function}", hint="a test plan")
            return presets.tensor_parallel().apply(mod, function)

    class Stop(Exception):
        """Not a DistxError: nothing catches it on the way out."""

    compiled = []

    def stop(mod, *args, **kwargs):
        compiled.append(sorted(gv.name_hint for gv, f in mod.functions.items()
                               if f.attrs is not None and "global_symbol" in f.attrs))
        raise Stop

    monkeypatch.setattr("tvm_distx.llm.causal_lm.compile_module", stop)  # where CausalLM calls it
    with caplog.at_level("WARNING", logger="tvm_distx.llm.causal_lm"), pytest.raises(Stop):
        CausalLM.from_hf(build("llama", layers=1), num_ranks=2, backend="emulate",
                         max_length=12, max_batch=2, plan=NoBatches())
    assert compiled == [["decode", "prefill"]]
    assert "the batched functions do not shard or compile (" in caplog.text
    assert "NoBatches does not shard prefill_batch" in caplog.text


def test_a_prompt_too_long_for_the_cache_is_refused_before_any_call(llama):
    _, lm = llama
    with pytest.raises(td.errors.ArgumentError, match="need 36 cache positions; the model was "
                                               "exported for 32"):
        lm.generate(prompt_ids(30, seed=4), max_new_tokens=7)
    calls = lm.session.calls
    with pytest.raises(td.errors.ArgumentError, match="a batch padded to 30 tokens needs 36 cache "
                                               "positions; the model was exported for 32"):
        lm.generate(BATCH + [prompt_ids(30, seed=4)], max_new_tokens=7)  # the second chunk's
    assert lm.session.calls == calls


@pytest.fixture(scope="module")
def bundle(llama, tmp_path_factory):
    """The Llama fixture exported as a generation bundle (2 ranks)."""
    return llama[1].export(tmp_path_factory.mktemp("bundle") / "llama")


def _generate_cli(*argv: str, timeout: float = 300):
    import subprocess

    return subprocess.run([sys.executable, "-m", "tvm_distx", "generate", *map(str, argv)],
                          capture_output=True, text=True, timeout=timeout)


def test_a_generation_bundle_serves_the_same_tokens_from_the_command_line(
        llama, bundle, tmp_path):
    model, _ = llama
    prompt = prompt_ids(4, seed=5)
    done = _generate_cli(bundle, "--ids", *prompt, "--max-new-tokens", "6",
                         "-o", tmp_path / "out.npy")
    assert done.returncode == 0, done.stderr
    want = greedy(model, prompt, 6)
    assert done.stdout.split() == [str(t) for t in want]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), want[None, :])
    bad = _generate_cli(tmp_path, "--ids", "1", timeout=120)
    assert bad.returncode == 2 and "is not a generation bundle" in bad.stderr
    assert "Traceback" not in bad.stderr and "CausalLM.from_hf(model).export" in bad.stderr


def test_a_ranks_bytes_are_its_weights_its_cache_at_max_length_and_activations(llama, bundle):
    from tvm_distx.bundle.footprint import rank_bytes
    from tvm_distx.bundle.generation import read_generation

    _, lm = llama
    info = read_generation(bundle)
    found = rank_bytes(bundle)
    # the compile's own count, and the one int32 that the bundle makes for each rank: the
    # first row of its block of the vocabulary (the embedding's lookup takes it)
    assert [r.weights - 4 for r in found] == lm.weight_bytes_per_rank
    # the larger cache (the batch of 3's), its key-value heads split over the 2 ranks
    assert info.batch_cache.nbytes() > info.cache.nbytes()
    assert [r.cache for r in found] == [info.batch_cache.nbytes() // 2] * 2
    # activations: the batched prefill of 3 prompts of max_length tokens needs at least one
    # layer's hidden states, twice; and less than every layer's values made by every weight
    # matrix, whole, for those tokens, twice, beside a new cache
    config, rows = llama[0].config, 3 * info.batch_cache.max_length
    layer = 4 * config.hidden_size + 3 * config.intermediate_size  # q k v o, gate up down
    whole = config.num_hidden_layers * layer + 2 * config.vocab_size
    assert all(2 * rows * config.hidden_size * 4 <= r.activations
               < 2 * rows * whole * 4 + info.batch_cache.nbytes() for r in found)


def _hostfile(tmp_path, mem: str) -> Path:
    path = tmp_path / f"hosts-{mem}.txt"
    path.write_text(f"localhost:2 mem={mem}   # this host, as the ranks' only host\n")
    return path


def test_a_host_too_small_for_its_ranks_is_refused_before_launch_and_one_that_fits_runs(
        llama, bundle, tmp_path):
    from tvm_distx.bundle.footprint import rank_bytes
    from tvm_distx.hosts.memory import format_size
    from tvm_distx.runtime.memory import RANK_RUNTIME_BYTES

    model, _ = llama
    found = rank_bytes(bundle)
    parts = [sum(getattr(r, k) for r in found) for k in ("weights", "cache", "activations")]
    need = sum(parts) + 2 * RANK_RUNTIME_BYTES
    prompt = prompt_ids(4, seed=5)
    done = _generate_cli(bundle, "--ids", *prompt, "--max-new-tokens", "6",
                         "--hostfile", _hostfile(tmp_path, "100M"), timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"tvm-distx: error: [host-memory] host localhost needs {format_size(need)} for ranks "
        f"0-1 (weights {format_size(parts[0])}, cache {format_size(parts[1])}, activations "
        f"{format_size(parts[2])}, runtime {format_size(2 * RANK_RUNTIME_BYTES)}), but has "
        "100 MiB (mem= of its hostfile line)",
        "hint: cut the model into more pipeline stages (--stages), spread the ranks over more "
        "hosts (--hostfile), or use a smaller format (--quantization q8 or q4)"]
    with pytest.raises(td.errors.HostMemoryError) as caught:  # in Python: Python's hint
        CausalLM.from_bundle(bundle, hosts="localhost:2 mem=100M")
    assert (caught.value.host, caught.value.needed, caught.value.available) == (
        "localhost", need, 100 << 20)
    assert str(caught.value).endswith('or use a smaller format (quantization="q8" or "q4")')
    fits = _generate_cli(bundle, "--ids", *prompt, "--max-new-tokens", "6",
                         "--hostfile", _hostfile(tmp_path, "64G"))
    assert fits.returncode == 0, fits.stderr
    assert fits.stdout.split() == [str(t) for t in greedy(model, prompt, 6)]


@pytest.mark.parametrize("backend", ["disco", "emulate"])
def test_the_command_line_generates_the_same_tokens_on_every_backend(
        llama, bundle, backend, capsys):
    """... with the 4-token prompt prefilled in chunks of 3 and 1."""
    from tvm_distx.cli.main import main

    model, _ = llama
    prompt = prompt_ids(4, seed=5)
    code = main(["generate", str(bundle), "--ids", *map(str, prompt), "--max-new-tokens", "6",
                 "--backend", backend, "--ranks", "2", "--prefill-chunk", "3"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.split() == [str(t) for t in greedy(model, prompt, 6)]


def test_a_bundle_keeps_the_batched_functions(llama, bundle):
    model, lm = llama
    with CausalLM.from_bundle(bundle, backend="emulate", num_ranks=2) as served:
        assert served.batch_cache == lm.batch_cache
        rows = served.generate(BATCH[:2], max_new_tokens=4)
    for prompt, row in zip(BATCH, rows):
        np.testing.assert_array_equal(row, greedy(model, prompt, 4))
    with pytest.raises(td.errors.ArgumentError, match=r"from_bundle\(num_ranks=3\).*2 ranks"):
        CausalLM.from_bundle(bundle, backend="emulate", num_ranks=3)


@pytest.mark.parametrize("argv, message, hint", [
    (("--backend", "gpu"), "unknown backend 'gpu'",
     "hint: --backend mpi | --backend disco | --backend emulate"),
    (("--ranks", "3"), "generate --ranks 3: the bundle", "hint: --ranks 2, or leave --ranks out"),
])
def test_a_bad_backend_or_rank_count_is_one_line_with_a_flag_hint(bundle, argv, message, hint):
    done = _generate_cli(bundle, "--ids", "1", "2", *argv, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and hint in done.stderr
    assert "Traceback" not in done.stderr and "from_bundle(" not in done.stderr


def test_a_rank_killed_mid_generation_ends_it_naming_the_rank(llama):
    """The caches live on the ranks: losing one ends the generation at once, with its name."""
    import os
    import signal
    import time

    model, lm = llama
    session = lm.exe.session(2, params=lm.weights, function=("prefill", "decode"))
    doomed = CausalLM(lm.cache, session, exe=lm.exe, weights=lm.weights)
    stream = doomed.stream(prompt_ids(5, 11), max_new_tokens=10)
    next(stream), next(stream)  # the prefill and one decode step ran
    pids = [p.pid for p in session.ranks]
    os.kill(pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(td.errors.LaunchError, match="rank 1"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # no orphan left



# ------------------------------------------------------------------ sampling on the ranks
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1)


def test_a_seed_gives_the_same_sampled_tokens_on_every_backend(llama, bundle):
    _, lm = llama
    prompt = prompt_ids(5, seed=8)
    want = lm.generate(prompt, NEW_TOKENS, seed=3, **SAMPLED)
    assert not np.array_equal(want, lm.generate(prompt, NEW_TOKENS))  # not greedy
    assert not np.array_equal(want, lm.generate(prompt, NEW_TOKENS, seed=4, **SAMPLED))
    for backend in ("emulate", "disco"):
        with CausalLM.from_bundle(bundle, backend=backend, num_ranks=2) as served:
            np.testing.assert_array_equal(served.generate(prompt, NEW_TOKENS, seed=3, **SAMPLED),
                                          want, err_msg=backend)
    # a batch draws row after row from one generator: seeded, it repeats too
    batch = lm.generate(BATCH, NEW_TOKENS, seed=3, **SAMPLED)
    again = lm.generate(BATCH, NEW_TOKENS, seed=3, **SAMPLED)
    for row, same in zip(batch, again):
        np.testing.assert_array_equal(row, same)


def test_top_k_1_is_greedy_and_the_penalty_applies_to_greedy_as_in_transformers(llama):
    model, lm = llama
    prompt = prompt_ids(6, seed=9)
    np.testing.assert_array_equal(lm.generate(prompt, NEW_TOKENS, do_sample=True, top_k=1,
                                              seed=1)[0], greedy(model, prompt, NEW_TOKENS))
    with torch.no_grad():
        want = model.generate(torch.from_numpy(prompt[None, :]), max_new_tokens=NEW_TOKENS,
                              do_sample=False, repetition_penalty=1.5, eos_token_id=None,
                              pad_token_id=0)[0].numpy()
    np.testing.assert_array_equal(lm.generate(prompt, NEW_TOKENS, repetition_penalty=1.5)[0],
                                  want)


def test_the_first_sampled_token_follows_the_processed_softmax(llama):
    """A chi-square test over 1,500 seeded draws of the first token, against transformers'
    logits processed by the same options."""
    model, lm = llama
    prompt = prompt_ids(5, seed=10)
    options = dict(do_sample=True, temperature=2.0, top_k=20)
    with torch.no_grad():
        logits = model(torch.from_numpy(prompt[None, :])).logits[0, -1].numpy()
    probs = Sampling(**options).probabilities(logits, prompt)
    draws = np.bincount([int(lm.generate(prompt, 1, seed=seed, **options)[0, -1])
                         for seed in range(1500)], minlength=probs.size)
    assert draws[probs == 0].sum() == 0
    expected = probs * draws.sum()
    common = expected >= 5  # the chi-square approximation wants 5 or more per cell
    observed = np.append(draws[common], draws[~common].sum())
    expected = np.append(expected[common], expected[~common].sum())
    keep = expected > 0
    _, p_value = stats.chisquare(observed[keep], expected[keep])
    assert p_value > 1e-3, (p_value, observed, expected)
