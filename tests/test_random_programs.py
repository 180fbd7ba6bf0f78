"""Randomized equivalence: random programs, randomly sharded, give numpy's numbers.

Programs come from ``randprog/`` (matmul, elementwise, reductions, reshape,
permute_dims, softmax, private functions called once or twice, changes of
placement) on meshes (2,), (4,), (2, 2) and (2, 4). Each is compiled with
:func:`tvm_distx.compile` and run on every rank; the global result must equal
numpy's on one process (float32 against float64, ``rtol=atol=1e-4``) with the
exact shape. Nothing may be refused: every generated program is valid.

* Emulated ranks: hypothesis draws programs (``derandomize=True``: every
  run checks the same cases; a failure is printed with its program and
  TVMScript, and with ``TVM_DISTX_SHRINK=1`` shrunk first).
  ``TVM_DISTX_STRESS_CASES=N`` raises the number of cases. Seeded programs
  (numpy's draws, larger on average) run on emulated ranks too.
* MPI ranks: seeded programs, one ``mpiexec`` launch per rank count (2, 4 and
  8 ranks) running the whole batch (``tests/mpi/run_random.py``), plus a few
  through the public ``DistExecutable.run(backend="mpi")``.
* Replay: ``TVM_DISTX_SEED=<seed> [TVM_DISTX_BACKEND=mpi] pytest
  tests/test_random_programs.py -k replay`` runs one seeded program; without
  the variable the replay test runs a few fixed seeds.

At the end the module writes ``random programs: N cases checked (E emulated,
M on MPI)``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings, strategies as st

import tvm_distx as td
from tvm_distx.layout.arrays import assemble_results, shard_array
from tvm_distx.runtime.mpi import mpiexec_path

from randprog import (HypothesisDrawer, SeededDrawer, build_module, compare, generate,
                      random_inputs, reference, report, run_case)

HERE = Path(__file__).parent

#: Cases drawn by hypothesis on emulated ranks (the stress mode raises it).
EMULATED_CASES = int(os.environ.get("TVM_DISTX_STRESS_CASES", "120"))
#: Seeded programs on emulated ranks besides (numpy's draws give larger programs
#: than hypothesis', which favours small ones): chunks of seeds from SEEDED_FIRST.
SEEDED_FIRST, SEEDED_CHUNKS, SEEDED_CHUNK = 200_000, 6, 25
#: Shrinking a failing program can take minutes (each try compiles): opt in
#: with ``TVM_DISTX_SHRINK=1`` to get a minimal program.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [Phase.shrink] if os.environ.get("TVM_DISTX_SHRINK") == "1" else [])

#: Seeded programs run on real MPI ranks, per mesh (first seeds drawing that mesh).
MPI_CASES = {(2,): 14, (4,): 10, (2, 2): 10, (2, 4): 6}
#: The first seed of the MPI programs (distinct from the replayed ones).
MPI_FIRST_SEED = 100_000
#: Seeds run through ``DistExecutable.run(backend="mpi")``, one launch each.
LAUNCHER_SEEDS = (23, 12)  # meshes (2,) and (2, 2)

#: Seeds the replay test runs when TVM_DISTX_SEED is not set. (The bugs these
#: tests found have their own deterministic tests, beside the code they fixed;
#: a seed names a program only for one version of the generator.)
REGRESSION_SEEDS: tuple[int, ...] = (0, 1, 2)

COUNTS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def case_counts(request):
    """Write how many cases the module checked, once its tests are done."""
    yield COUNTS
    emulated, mpi = COUNTS["emulate"], COUNTS["mpi"]
    line = (f"random programs: {emulated + mpi} cases checked ({emulated} emulated, {mpi} on "
            f"MPI), each equal to numpy")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # past pytest's output capture
            reporter.write_line("")
            reporter.write_line(line)
    logging.getLogger(__name__).info(line)


@pytest.fixture(autouse=True)
def quiet_propagation():
    """The propagation pass warns about un-legalized operators; ours are legalized."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


# ---------------------------------------------------------------------- emulated
@settings(max_examples=EMULATED_CASES, derandomize=True, database=None, deadline=None,
          print_blob=True, phases=PHASES, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_programs_on_emulated_ranks_equal_numpy(data):
    program = generate(HypothesisDrawer(data))
    seed = data.draw(st.integers(0, 2**16), label="input seed")
    note(f"input seed {seed}\n" + report(program, None, build_module(program)))
    run_case(program, random_inputs(program, seed), "emulate")
    COUNTS["emulate"] += 1


@pytest.mark.parametrize("chunk", range(SEEDED_CHUNKS))
def test_seeded_programs_on_emulated_ranks_equal_numpy(chunk):
    failures = []
    for seed in range(SEEDED_FIRST + chunk * SEEDED_CHUNK,
                      SEEDED_FIRST + (chunk + 1) * SEEDED_CHUNK):
        program = generate(SeededDrawer(seed))
        try:
            run_case(program, random_inputs(program, seed), "emulate")
        except Exception as err:  # noqa: BLE001 - every failing seed is reported
            failures.append(f"{report(program, seed, build_module(program))}\n"
                            f"{type(err).__name__}: {err}")
            continue
        COUNTS["emulate"] += 1
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------------- replay
def _replay_seeds() -> list[int]:
    if os.environ.get("TVM_DISTX_SEED"):
        return [int(os.environ["TVM_DISTX_SEED"])]
    return list(REGRESSION_SEEDS)


@pytest.mark.parametrize("seed", _replay_seeds())
def test_replay_seeded_program(seed):
    backend = os.environ.get("TVM_DISTX_BACKEND", "emulate")
    program = generate(SeededDrawer(seed))
    print(report(program, seed, build_module(program)))
    run_case(program, random_inputs(program, seed), backend)
    COUNTS["mpi" if backend == "mpi" else "emulate"] += 1


# ---------------------------------------------------------------------- MPI
def mpi_seeds(num_devices: int) -> list[int]:
    """The seeds of the MPI batch on ``num_devices`` ranks (quotas of :data:`MPI_CASES`)."""
    wanted = {mesh: n for mesh, n in MPI_CASES.items() if int(np.prod(mesh)) == num_devices}
    seeds, seed = [], MPI_FIRST_SEED
    while any(wanted.values()):
        mesh = generate(SeededDrawer(seed)).mesh
        if wanted.get(mesh):
            wanted[mesh] -= 1
            seeds.append(seed)
        seed += 1
    return seeds


@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_random_programs_on_mpi_ranks_equal_numpy(num_devices, tmp_path):
    cases = []  # (name, seed, program, executable, inputs)
    listing = []
    for seed in mpi_seeds(num_devices):
        program = generate(SeededDrawer(seed))
        try:
            exe = td.compile(build_module(program), schedule=False)
        except Exception as err:  # noqa: BLE001 - reported with the program
            raise AssertionError(report(program, seed, build_module(program))) from err
        name = f"s{seed}"
        inputs = random_inputs(program, seed)
        signature = exe.signatures["main"]
        for rank in range(num_devices):
            args = [shard_array(value, spec.sharding, rank)
                    for spec, value in zip(signature.params, inputs) if spec.held_by(rank)]
            np.savez(tmp_path / f"{name}.rank{rank}.in.npz",
                     **{f"arg{i}": a for i, a in enumerate(args)})
        exe.vm_exec.export_library(str(tmp_path / f"{name}.so"))
        listing.append({"name": name, "library": f"{name}.so", "entries": exe.entries["main"]})
        cases.append((name, seed, program, exe, inputs))
    (tmp_path / "programs.json").write_text(json.dumps(listing))
    env = {**os.environ, "TVM_NUM_THREADS": "1"}
    done = subprocess.run([mpiexec_path(), "-n", str(num_devices), sys.executable,
                           str(HERE / "mpi" / "run_random.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        started = [line[6:] for line in done.stdout.splitlines() if line.startswith("START ")]
        culprit = next((c for c in cases if started and c[0] == started[-1]), None)
        where = report(culprit[2], culprit[1], build_module(culprit[2])) if culprit else ""
        raise AssertionError(f"mpiexec failed (code {done.returncode}) in program "
                             f"{started[-1] if started else '?'}\n{where}\n{done.stderr[-3000:]}")
    failures = []
    for name, seed, program, exe, inputs in cases:
        signature = exe.signatures["main"]
        outs = []
        for rank in range(num_devices):
            path = tmp_path / f"{name}.rank{rank}.out.npz"
            if not path.exists():
                outs.append(None)
                continue
            fields = np.load(path)
            values = [fields[f"out{i}"] for i in range(len(fields.files))]
            outs.append(tuple(values) if signature.tuple_result else values[0])
        try:
            compare(program, assemble_results(signature, outs), reference(program, inputs))
        except AssertionError as err:
            failures.append(f"{report(program, seed, build_module(program))}\n{err}")
            continue
        COUNTS["mpi"] += 1
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("seed", LAUNCHER_SEEDS)
def test_random_programs_through_the_mpi_launcher(seed):
    program = generate(SeededDrawer(seed))
    note_text = report(program, seed, build_module(program))
    try:
        run_case(program, random_inputs(program, seed), "mpi", timeout=120)
    except Exception as err:
        raise AssertionError(note_text) from err
    COUNTS["mpi"] += 1
