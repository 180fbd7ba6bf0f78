"""RISC-V boards end to end: bundles for RVV run as riscv64 processes with no TVM on the board.

Two emulated boards (``board_hosts``, tests/boards.py: riscv64 Debian roots with Python, numpy
and Open MPI, run by qemu-user) are two hosts; each gets its own rank's weights by
``tvm-distx deploy`` and runs its rank from the bundle's plan with the board's own ``mpiexec``
(``./run.sh run|generate --hostfile``). The same model also runs on this machine's board
backend, against transformers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tvm_distx as td  # noqa: E402
from tvm_distx import ShardingRule  # noqa: E402
from tvm_distx.llm.causal_lm import CausalLM  # noqa: E402
from tvm_distx.passes import AnnotateSharding  # noqa: E402

from locations import TESTS_DIR  # noqa: E402
from reference import mlp_twice  # noqa: E402
from rvv_tools import require_tools  # noqa: E402

PROMPT = np.array([3, 17, 42, 5, 99, 23])
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama with grouped-query attention (hidden 128, 2 layers, 4 heads, 2 kv heads)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        expected = model.generate(torch.from_numpy(PROMPT[None]), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0]
    return model, expected.numpy()


@pytest.fixture(scope="module")
def served(llama):
    """The Llama on 2 ranks of this machine's board backend (kept for the module)."""
    with CausalLM.from_hf(llama[0], num_ranks=2, backend="board",
                          max_length=len(PROMPT) + NEW_TOKENS) as lm:
        yield lm


def test_the_board_backend_generates_transformers_tokens(llama, served):
    assert type(served.session).__name__ == "BoardSession"
    out = served.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(out[0], llama[1])
    assert served.session.calls == NEW_TOKENS  # one prefill, then one decode per token


def _deploy(bundle: Path, hosts, dest: str) -> None:
    hostfile = hosts.hostfile(hosts.shared / "boards.txt", hosts=hosts.names[:2])
    done = subprocess.run([sys.executable, "-m", "tvm_distx", "deploy", str(bundle),
                           "--hostfile", str(hostfile), "--dest", dest, "--rsh", hosts.rsh,
                           "--python", "python3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def _only_own_weights(hosts, dest: str) -> None:
    for rank, host in enumerate(hosts.names[:2]):
        held = hosts.run(host, f"ls {dest}/weights").stdout.split()
        assert held == [f"rank{rank}.safetensors"], (host, held)
        assert hosts.run(host, "find / -xdev -name 'libtvm*' | head -1").stdout == ""


@pytest.fixture(scope="module")
def seed_bundle(tmp_path_factory):
    require_tools()
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    exe = td.compile(AnnotateSharding(rules)(td.load_module(
        TESTS_DIR / "data" / "seed_tensor_parallel.py")), target="rvv")
    rng = np.random.default_rng(11)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    bundle = exe.export(tmp_path_factory.mktemp("rvv") / "seed", params={"A": A, "B": B})
    return bundle, x, mlp_twice(x, A, B)


def test_two_boards_run_the_seed_program_each_with_its_own_weights(seed_bundle, board_hosts):
    bundle, x, expected = seed_bundle
    hosts, dest = board_hosts, f"{board_hosts.deploy_root}/seed"
    _deploy(bundle, hosts, dest)
    _only_own_weights(hosts, dest)
    np.save(hosts.shared / "x.npy", x)
    out = hosts.shared / "seed-out"
    hosts.run(hosts.names[0], f"cd {hosts.shared} && {dest}/run.sh run -i x.npy -o {out} "
              f"--hostfile {hosts.shared}/boards.txt", timeout=300)
    np.testing.assert_allclose(np.load(out / "out0.npy"), expected, rtol=1e-5, atol=1e-5)


def test_two_boards_run_bfloat16_weights_with_numpy_that_has_no_bfloat16(board_hosts,
                                                                         tmp_path):
    """A board's numpy has no bfloat16: the ranks hold the weights as 16-bit patterns, and the
    RVV kernels widen them as they read them."""
    require_tools()
    rules = [ShardingRule(param="A", result="S[1]", function="mlp"),
             ShardingRule(param="B", result="S[0]", function="mlp")]
    mod = AnnotateSharding(rules)(td.load_module(TESTS_DIR / "data" / "seed_tensor_parallel.py"))
    rng = np.random.default_rng(12)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    stored, weights = td.quantize(mod, {"A": A, "B": B}, "bf16")
    bundle = td.compile(stored, target="rvv").export(tmp_path / "bf16", params=weights)
    hosts, dest = board_hosts, f"{board_hosts.deploy_root}/bf16"
    assert hosts.run(hosts.names[0], "python3 -c 'import ml_dtypes'", check=False).returncode
    _deploy(bundle, hosts, dest)
    np.save(hosts.shared / "x16.npy", x)
    out = hosts.shared / "bf16-out"
    hosts.run(hosts.names[0], f"cd {hosts.shared} && {dest}/run.sh run -i x16.npy -o {out} "
              f"--hostfile {hosts.shared}/boards.txt", timeout=300)
    decoded = [np.asarray(weights[n]).astype("float32") for n in "AB"]
    np.testing.assert_allclose(np.load(out / "out0.npy"), mlp_twice(x, *decoded), rtol=1e-4,
                               atol=1e-4)


def test_a_board_without_vectors_dies_of_an_illegal_instruction(seed_bundle, board_hosts):
    """The same deployed bundle, rank 0's board emulated without the vector extension."""
    hosts, dest = board_hosts, f"{board_hosts.deploy_root}/seed"
    if not hosts.run(hosts.names[0], f"test -x {dest}/run.sh", check=False).returncode == 0:
        _deploy(seed_bundle[0], hosts, dest)
        np.save(hosts.shared / "x.npy", seed_bundle[1])
    done = hosts.run(hosts.names[0], f"cd {hosts.shared} && QEMU_CPU=rv64,v=false "
                     f"{dest}/run.sh run -i x.npy -o {hosts.shared}/novec "
                     f"--hostfile {hosts.shared}/boards.txt", check=False, timeout=300)
    assert done.returncode == 2
    first = done.stderr.strip().splitlines()[0]
    assert first.startswith("error: a rank died of signal 4 (SIGILL, Illegal instruction)"), \
        done.stderr
    assert "Traceback" not in done.stderr


def _generate_on_boards(bundle, hosts, name: str, expected: np.ndarray):
    """``bundle`` deployed to the boards (each its own weights), generating from the first:
    its tokens must be ``expected``, on standard output and in the saved array."""
    dest = f"{hosts.deploy_root}/{name}"
    _deploy(bundle, hosts, dest)
    _only_own_weights(hosts, dest)
    out = hosts.shared / f"{name}-tokens.npy"
    done = hosts.run(hosts.names[0], f"{dest}/run.sh generate --ids "
                     f"{' '.join(map(str, PROMPT))} --max-new-tokens {NEW_TOKENS} -o {out} "
                     f"--hostfile {hosts.shared}/boards.txt", timeout=600)
    np.testing.assert_array_equal(np.load(out)[0], expected)
    assert done.stdout.split() == [str(t) for t in expected]
    return done


def test_two_boards_generate_transformers_tokens(llama, served, board_hosts, tmp_path):
    require_tools()
    bundle = served.export(tmp_path / "llama", target="rvv")
    done = _generate_on_boards(bundle, board_hosts, "llama", llama[1])
    assert "tokens/s" in done.stderr  # the job's timings, and nothing of MPI's


def test_two_boards_generate_transformers_tokens_as_two_pipeline_stages(llama, board_hosts,
                                                                        tmp_path):
    """Each board one stage (one layer, its weights and cache); a prompt of run-time length
    moves from the first board to the second."""
    require_tools()
    with CausalLM.from_hf(llama[0], num_ranks=2, stages=2, backend="board",
                          max_length=len(PROMPT) + NEW_TOKENS, compile_cache=False) as lm:
        held = lm.weight_bytes_per_rank
        bundle = lm.export(tmp_path / "stages", target="rvv")
    assert held[0] != held[1]  # the embedding with the first stage, the head with the last
    _generate_on_boards(bundle, board_hosts, "stages", llama[1])
