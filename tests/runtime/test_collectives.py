"""Every ``tvm_distx.ccl.*`` collective equals numpy on the emulated and disco backends.

One compiled module holds a rank program per mesh (see ``collective_cases``):
1-D meshes of 2 and 4 devices and a 2x2 mesh (groups along each axis and
along both), with float32, float16 and int32 inputs. The MPI backend runs its
checks of the same functions in ``tests/mpi/ccl_worker.py`` (``runtime/test_mpi_ccl.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from collective_cases import cases_for, check, device_inputs, rank_module
from tvm_distx.runtime import emulate
from tvm_distx.runtime.disco import run_disco

MESHES = {"mesh2": (2,), "mesh4": (4,), "mesh2x2": (2, 2)}


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """The rank programs of every mesh, compiled once: (executable, library path, cases)."""
    cases = {name: cases_for(shape) for name, shape in MESHES.items()}
    executable = tvm.compile(rank_module(cases), target=tvm.target.Target({"kind": "llvm"}))
    library = tmp_path_factory.mktemp("collectives") / "collectives.so"
    executable.export_library(str(library))
    return executable, library, cases


@pytest.mark.parametrize("name", list(MESHES))
def test_every_collective_on_the_emulator_equals_numpy(program, name):
    executable, _, cases = program
    devices = list(range(int(np.prod(MESHES[name]))))
    outs = emulate(executable, [device_inputs(cases[name], d) for d in devices], devices,
                   entry=name)
    for device, out in zip(devices, outs):
        check(cases[name], device, out)


@pytest.mark.parametrize("name", list(MESHES))
def test_every_collective_on_disco_equals_numpy(program, name):
    _, library, cases = program
    devices = list(range(int(np.prod(MESHES[name]))))
    outs = run_disco(library, [name] * len(devices),
                     [device_inputs(cases[name], d) for d in devices], timeout=120)
    for device, out in zip(devices, outs):
        check(cases[name], device, out)
