"""``DistExecutable``: the built rank programs, run on any backend and exported as a bundle.

::

    exe = tvm_distx.compile(annotated, target="x86")          # tvm_distx.compiler.pipeline
    y = exe.run(x, params={"A": A, "B": B}, backend="mpi")   # global numpy in and out
    exe.export("bundle/", params={"A": A, "B": B})           # library, weight shards, manifest

This module only packages and runs what :func:`tvm_distx.compiler.pipeline.compile`
built; it imports nothing of the compiler. :class:`DistExecutable` keeps the
global signature (shapes, dtypes, shardings) of each public function, so it
can cut global inputs into shards and put results together.

Backends of :meth:`DistExecutable.run` and :meth:`DistExecutable.session` (the
list is :data:`tvm_distx.runtime.backends.BACKENDS`):

``"mpi"``
    One process per rank under ``mpiexec`` (:mod:`tvm_distx.runtime.mpi`).
``"disco"``
    TVM's disco ``ProcessSession`` on this host, with our shared-memory
    collectives (:mod:`tvm_distx.runtime.disco`).
``"emulate"``
    Every rank a thread of this process (:mod:`tvm_distx.runtime.emulated`).

A run is a session opened on the program's bundle, called once and closed. The
bundle (the library and the manifest, no weights: a run passes them) is
exported once per executable, at its first run, into a private directory
removed with the executable.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
import shutil
import tempfile
from typing import Mapping
import weakref

import numpy as np
import tvm
from tvm import relax

from tvm_distx import ccl
from tvm_distx.runtime.board.payload import write_board_runtime
from tvm_distx.runtime.board.program import RUNTIME_LIBRARY
from tvm_distx.compiler.board_plan import board_runtime
from tvm_distx.compiler.rvv import write_kernels
from tvm_distx.bundle.manifest import (FORMAT, MANIFEST, VERSION, WeightLink, sha256_file,
                                       write_rank_weights)
from tvm_distx.bundle.signature import SHARDS, FunctionSignature
from tvm_distx.errors import ArgumentError
from tvm_distx.ir import helpers as _ir
from tvm_distx.layout import MeshTable, shard_bounds
from tvm_distx.layout.derived import Derivations, host_array
from tvm_distx.layout.mesh import DeviceMesh
from tvm_distx.runtime.backends import check_backend, launch, open_session

__all__ = ["DistExecutable"]

#: The rank plan's file name in a bundle.
PLAN = "plan.json"

logger = logging.getLogger(__name__)


class DistExecutable:
    """The compiled rank programs of a distributed module.

    Attributes
    ----------
    module : tvm.IRModule
        The rank-local module that was built.
    signatures : dict of str to FunctionSignature
        The global view of each public function.
    num_ranks : int
        How many ranks (devices) the program runs on.
    entries : dict of str to list
        Per public function, the function each rank runs (None: none).
    derivations : dict of str to Derivations
        Per public function, the parameters cut from a user's weight (the
        segments of a fused projection, see
        :class:`tvm_distx.passes.SplitFusedProjections`). ``run`` and
        ``export`` cut them from the weights they are given.
    plan : dict or None
        The program the library's virtual machine runs, as data
        (:func:`tvm_distx.compiler.board_plan.rank_plan`): what the board's ranks
        run with the library's kernels and no TVM. None when the plan cannot
        write the program; ``plan_refusal`` then says why.
    local_view : tvm.IRModule or None
        The module after the ``local_view`` stage of the compile
        (:func:`tvm_distx.compiler.pipeline.run_stages`): global shapes as
        DTensors, every redistribute and all-reduce still visible. It is what
        :func:`tvm_distx.reports.comm_report.comm_report` reads, kept so that
        nothing lowers the program a second time to count its bytes.
    """

    def __init__(self, module: tvm.IRModule, signatures: dict[str, FunctionSignature],
                 vm_exec, target, *, num_ranks: int, entries: dict[str, list],
                 built: tvm.IRModule | None = None,
                 derivations: Mapping[str, Derivations] | None = None,
                 plan: dict | None = None, plan_refusal: str | None = None,
                 local_view: tvm.IRModule | None = None) -> None:
        self.module = module
        self.local_view = local_view
        self.plan, self.plan_refusal = plan, plan_refusal
        self.built = built if built is not None else module
        self.signatures = signatures
        self.vm_exec = vm_exec
        self.target = target
        self.num_ranks = num_ranks
        self.entries = entries
        self.derivations = dict(derivations or {})
        self.meshes = MeshTable(module)
        self._run_bundle: Path | None = None  # exported at the first run (see run)
        self._library: Path | None = None  # written at the first export (see _write_library)

    # ---------------------------------------------------------------- running
    def run(self, *inputs, params: Mapping | None = None, backend: str = "mpi",
            function: str = "main", timeout: float = 300.0, **options):
        """Run on every rank with global inputs; return the global result.

        Parameters
        ----------
        *inputs : array
            The global values of the parameters not given in ``params``, in
            order (numpy arrays or torch tensors).
        params : mapping of str to array, optional
            Global values by parameter name (weights, typically). A fused
            weight that the program uses per segment is given whole, under the
            user's name; it is cut here (see :attr:`derivations`).
        backend : {"mpi", "disco", "emulate"}
            How the ranks run (see the module documentation).
        function : str
            The public function to run.
        timeout : float
            Seconds before a stuck run is stopped.
        **options
            Passed to the backend (for ``"mpi"``: the options of
            :class:`~tvm_distx.runtime.mpi.MPISession`, ``hostfile`` and the
            rest of the hosts' among them).

        Returns
        -------
        numpy.ndarray or tuple of numpy.ndarray

        Raises
        ------
        ArgumentError
            For an unknown backend or function, or inputs that do not fit.
        LaunchError
            If a rank fails or the run times out.
        """
        self._signature(function)
        check_backend(backend, options)
        if not self.target.runnable_here:
            raise ArgumentError(f"a program built for {self.target.name} cannot run on this host",
                                hint="export it with .export(dir) and run the bundle on the "
                                "target machines")
        return launch(self._bundle_for_runs(), list(inputs), params=params, function=function,
                      timeout=timeout, backend=backend, **options)

    def _bundle_for_runs(self) -> Path:
        """The program's bundle without weights, exported once and removed with ``self``."""
        if self._run_bundle is None or not self._run_bundle.is_dir():
            directory = Path(tempfile.mkdtemp(prefix="tvm-distx-run-"))
            try:
                self.export(directory, function=list(self.signatures))  # no weights
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            weakref.finalize(self, shutil.rmtree, str(directory), True)
            self._run_bundle = directory
        return self._run_bundle

    def session(self, num_ranks: int | None = None, *, backend: str = "mpi",
                params: Mapping | None = None, function: str = "main", timeout: float = 300.0,
                **options):
        """Launch the ranks once and keep them for many calls (a context manager).

        The weights in ``params`` are written once into a private bundle, and
        each rank loads its shards once; every
        :meth:`~tvm_distx.runtime.base.Session.run` after that costs
        milliseconds, not a launch::

            with exe.session(params=weights, backend="disco") as session:
                for x in batches:
                    y = session.run(x)

        Parameters
        ----------
        num_ranks : int, optional
            Must equal the program's rank count when given.
        backend : {"mpi", "disco", "emulate"}
            How the ranks run (see the module documentation): MPI processes
            (:class:`~tvm_distx.runtime.mpi.MPISession`), disco workers on
            this host (:class:`~tvm_distx.runtime.disco.DiscoSession`)
            or threads of this process
            (:class:`~tvm_distx.runtime.emulated.EmulatedSession`).
            All three take the same calls and give the same results.
        params : mapping of str to array, optional
            Global weights of ``function`` by name, stored for the session.
        function : str or sequence of str
            The function(s) whose parameters ``params`` names (see :meth:`export`).
        timeout : float
            Seconds for the ranks to start, and for each call by default.
        **options
            For ``"mpi"`` only: the options of
            :class:`~tvm_distx.runtime.mpi.MPISession`: ``hostfile`` or
            ``hosts``, ``rsh``, ``dest``, ``shared_fs``, ``mpiexec``, ``env`` (as
            for :meth:`run`).

        Returns
        -------
        tvm_distx.runtime.base.Session
            The session; its bundle is removed when it closes.

        Raises
        ------
        ArgumentError
            For an unknown backend, options the backend does not take, a rank
            count the program does not have, or a target that cannot run here.
        LaunchError
            If the ranks do not start.
        """
        check_backend(backend, options)
        if not self.target.runnable_here:
            raise ArgumentError(f"a program built for {self.target.name} cannot run on this host",
                                hint="export it with .export(dir) and open the session on the "
                                "target machines")
        if num_ranks is not None and num_ranks != self.num_ranks:
            raise ArgumentError(f"the program needs {self.num_ranks} ranks, not {num_ranks}",
                                hint=f"exe.session({self.num_ranks})")
        bundle = Path(tempfile.mkdtemp(prefix="tvm-distx-session-bundle-"))
        try:
            # a checkpoint's weights are read by each rank itself, never by this process
            self.export(bundle, params=params, function=function, link_checkpoint=True)
            session = open_session(bundle, backend=backend, timeout=timeout, **options)
        except BaseException:
            shutil.rmtree(bundle, ignore_errors=True)
            raise
        session._owned.append(bundle)
        return session

    def _derived(self, function: str, params: Mapping | None) -> dict:
        """``params`` with each fused weight replaced by the segments the program takes."""
        derivations = self.derivations.get(function)
        return derivations.bind(params) if derivations else dict(params or {})

    def _signature(self, function: str) -> FunctionSignature:
        if function not in self.signatures:
            raise ArgumentError(f"the program has no public function '{function}'",
                                hint=f"it has: {', '.join(self.signatures)}")
        return self.signatures[function]

    # ---------------------------------------------------------------- bundles
    def export(self, directory: str | os.PathLike, *, params: Mapping | None = None,
               function: str = "main", link_checkpoint: bool = False) -> Path:
        """Write a self-contained bundle: the library, each rank's weight shards, a manifest.

        Parameters
        ----------
        directory : path
            Created if missing; an existing bundle there is replaced.
        params : mapping of str to array, optional
            Global weights by parameter name of ``function`` (a fused weight
            whole, as for :meth:`run`). Each rank's file holds only its shard.
        function : str or sequence of str
            The function(s) whose parameters ``params`` names. A weight several
            functions take (the prefill and the decode of a model) is stored
            once per rank for all of them.
        link_checkpoint : bool
            Weights read from a checkpoint on demand (the
            :class:`~tvm_distx.sources.checkpoint.LazyTensor` values of
            :meth:`tvm_distx.llm.causal_lm.CausalLM.from_pretrained`) are not copied: the
            manifest names the checkpoint file, tensor and block of each rank's
            shard, and the rank reads it there itself. The checkpoint must then
            stay where it is, at the same path on every host. Sessions
            (:meth:`session`) link; a bundle to copy elsewhere should not.

        Returns
        -------
        pathlib.Path
            The bundle directory.

        Raises
        ------
        ArgumentError
            For an unknown parameter, a weight of the wrong shape or dtype, or a
            ``directory`` that is an existing file. Nothing is left behind then.
        """
        root = Path(directory)
        if root.exists() and not root.is_dir():
            raise ArgumentError(f"cannot export to {root}: it is an existing file",
                                hint="give a new or existing directory")
        functions = [function] if isinstance(function, str) else list(function)
        signatures = [self._signature(f) for f in functions]
        weights = {}
        for name, signature in zip(functions, signatures):
            own = self._derived(name, {k: v for k, v in (params or {}).items()
                                       if k in {p.name for p in signature.params}
                                       or k in self._sources(name)})
            if own:  # checks names, shapes and dtypes, before anything is written
                free = [p for p in signature.params if p.name not in own]
                signature.bind([np.zeros(_example_shape(p, self.meshes.as_dict()), p.dtype)
                                for p in free], own)
            weights[name] = own
        unused = sorted(set(params or {}) - {k for f in functions for k in
                                               {p.name for p in self._signature(f).params}
                                               | self._sources(f)})
        if unused:
            raise ArgumentError(f"'{' and '.join(functions)}' has no parameter named "
                                f"{', '.join(unused)}", hint="its parameters are "
                                f"{', '.join(p.name for p in signatures[0].params)}")
        created = not root.exists()
        try:
            return self._export(root, signatures, weights, functions, link_checkpoint)
        except BaseException:
            if created:  # no partial bundle left behind
                shutil.rmtree(root, ignore_errors=True)
            raise

    def _sources(self, function: str) -> set[str]:
        """The user's fused weights the function's parameters are cut from."""
        derivations = self.derivations.get(function)
        return {d.source for d in derivations.params} if derivations else set()

    def _export(self, root: Path, signatures: list[FunctionSignature], weights: dict,
                functions: list[str], link_checkpoint: bool) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        if (root / "weights").exists():
            shutil.rmtree(root / "weights")
        stored: dict[str, tuple] = {}  # name -> (signature, spec, value), one per weight
        for function, signature in zip(functions, signatures):
            for spec in signature.params:
                if spec.name not in weights[function]:
                    continue
                if spec.name in stored:  # a weight several functions take: stored once
                    if (stored[spec.name][1].sharding, stored[spec.name][1].shape) != \
                            (spec.sharding, spec.shape):
                        raise ArgumentError(
                            f"weight '{spec.name}' is placed differently in "
                            f"{', '.join(functions)}, so one bundle cannot hold it for both",
                            hint="give it the same placement in every function, or export "
                            "one bundle per function")
                    continue
                stored[spec.name] = (signature, spec, host_array(weights[function][spec.name]))
        files, links = [], []
        for rank in range(self.num_ranks):  # one rank's shards in memory at a time
            shards = {}
            for name, (signature, spec, value) in stored.items():
                if not signature.fed(spec, rank):  # not held, or TVM's feed off rank 0
                    continue
                if link_checkpoint and WeightLink.linkable(value) and signature.feed == SHARDS:
                    bounds = shard_bounds(spec.sharding, value.shape, rank)  # read by the rank
                    links.append(WeightLink.of(rank, name,
                                               value[tuple(slice(a, b) for a, b in bounds)]))
                else:
                    shards[name] = signature.rank_input(spec, value, rank)
            if shards:
                files.append(write_rank_weights(root, rank, shards))
        self._write_library(root)
        manifest = self._manifest(files, {f: sorted(weights[f]) for f in functions})
        if links:
            manifest["weight_links"] = [link.to_json() for link in links]
        manifest["library_sha256"] = sha256_file(root / manifest["library"])
        if self.plan is not None:
            (root / PLAN).write_text(json.dumps(self.plan, separators=(",", ":")) + "\n")
            manifest["plan"], manifest["plan_sha256"] = PLAN, sha256_file(root / PLAN)
            (root / RUNTIME_LIBRARY).write_bytes(board_runtime(self.target.cc or "gcc"))
            python = sorted(str(p.relative_to(root)) for p in (root / "python").rglob("*.py"))
            manifest["program_files"] = [PLAN, RUNTIME_LIBRARY, *python]
        else:
            (root / PLAN).unlink(missing_ok=True)
            if self.plan_refusal:  # why boards cannot run it, for their error
                manifest["plan_refusal"] = self.plan_refusal
            if self.target.is_riscv:
                logger.warning("this bundle has no rank plan, so boards without TVM cannot run "
                               "it: %s", self.plan_refusal)
            (root / RUNTIME_LIBRARY).unlink(missing_ok=True)
        (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _write_launcher(root, self.num_ranks, self.target.name, signatures[0],
                        set(weights[functions[0]]))
        logger.info("bundle written to %s (%d weight files)", root, len(files))
        return root

    def _write_library(self, root: Path) -> None:
        self._export_library(root / "lib.so")
        if self.target.is_riscv and self.plan is not None:  # boards run it with no TVM
            write_board_runtime(root, self.num_ranks, self.target.name)
        elif (root / "python").is_dir():  # a board bundle's runtime, replaced by this one
            shutil.rmtree(root / "python")
        if self.target.is_riscv:
            # no TVM runtime for riscv64 here: the kernels, alone, are checked under qemu

            write_kernels(self.built, self.target.target, root / "kernels",
                          cc=self.target.cc or "riscv64-linux-gnu-gcc")

    def _export_library(self, path: Path) -> None:
        """The library at ``path``: written once (LLVM emits its machine code then, which
        takes seconds for a real model), copied from a private copy at every later export
        (a session's bundle, then the compile cache's, say)."""
        if self._library is not None and self._library.is_file():
            shutil.copyfile(self._library, path)
            return
        self.target.export_library(self.vm_exec, path)
        private = Path(tempfile.mkdtemp(prefix="tvm-distx-library-"))
        weakref.finalize(self, shutil.rmtree, str(private), True)
        shutil.copyfile(path, private / path.name)
        self._library = private / path.name

    def _manifest(self, files: list[dict], weights: dict[str, list[str]]) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "library": "lib.so",
            "target": self.target.describe(),
            "num_ranks": self.num_ranks,
            "meshes": [{"name": name, "shape": list(m.shape), "devices": list(m.devices)}
                       for name, m in self.meshes.as_dict().items()],
            "ranks": [{"rank": r, "coordinates": _coordinates(self.meshes.as_dict(), r)}
                      for r in range(self.num_ranks)],
            "process_groups": _process_groups(self.meshes.as_dict()),
            "collectives": sorted(_collectives(self.module)),
            "functions": {
                name: {"entries": [e or None for e in self.entries[name]],
                       "params": [p.to_json(self.meshes) for p in sig.params],
                       "results": [r.to_json(self.meshes) for r in sig.results],
                       "tuple_result": sig.tuple_result,
                       "feed": sig.feed,
                       "weights": weights.get(name, []),
                       "derived": self.derivations.get(name, Derivations()).to_json()}
                for name, sig in self.signatures.items()
            },
            "weight_files": files,
        }


_LAUNCH_SCRIPT = """#!/bin/sh
# Run this bundle on {n} MPI ranks: ./run.sh [run] [-i input.npy ...] [-o out/]
# A generation bundle: ./run.sh generate --ids 1 2 3 --max-new-tokens 16 [-o out.npy]
# On several hosts: HOSTS=node0:2,node1 ./run.sh ..., or HOSTFILE=hosts.txt ./run.sh ...
# (ranks fill each host's slots in order; RSH= is the remote shell, ssh by default). Each
# host gets its ranks' share for the run, unless the bundle is deployed there (add
# --dest DIR: tvm-distx deploy) or on a shared filesystem (add --shared-fs). Needs
# tvm-distx, TVM's runtime and mpi4py at the same Python path on every host.
HERE="$(cd "$(dirname "$0")" && pwd)"
COMMAND=run
case "$1" in
    run) shift ;;
    generate) COMMAND=generate; shift ;;
esac
if [ "$COMMAND" = run ]; then set -- -n {n} "$@"; fi
exec tvm-distx "$COMMAND" "$HERE" ${{HOSTS:+--hosts "$HOSTS"}} \\
    ${{HOSTFILE:+--hostfile "$HOSTFILE"}} ${{RSH:+--rsh "$RSH"}} "$@"
"""


def _write_launcher(root: Path, num_ranks: int, target: str, signature: FunctionSignature,
                    weights: set[str]) -> None:
    """A launch script and a README beside the manifest.

    A RISC-V bundle runs on boards with no TVM: it gets the board's runtime and
    ``run.sh`` (:func:`tvm_distx.runtime.board.payload.write_board_runtime`); any other
    calls ``tvm-distx``.
    """
    board = (root / "python").is_dir()
    if not board:
        script = root / "run.sh"
        script.write_text(_LAUNCH_SCRIPT.format(n=num_ranks))
        script.chmod(0o755)
    inputs = [p for p in signature.params if p.name not in weights]
    lines = [
        f"# tvm-distx bundle: {signature.name} on {num_ranks} ranks, target {target}",
        "",
        "| file | contents |",
        "|---|---|",
        "| `manifest.json` | meshes, rank coordinates, process groups, collectives, "
        "entries, signatures, weight files with sha256 |",
        "| `lib.so` | the rank programs (one library for all ranks) |",
        "| `weights/rank<d>.safetensors` | the shards of the weights that rank d holds |",
        *(["| `plan.json` | the rank programs as data, run with numpy where there is no "
           "TVM |"] if (root / PLAN).is_file() else []),
        "| `run.sh` | " + ("`./run.sh run|generate`: the board's `mpiexec` on the plan, "
                          "no TVM |" if board else "`mpiexec` launch through `tvm-distx run` |"),
        *(["| `python/` | the board's runtime: the modules of tvm-distx it needs, no TVM |"]
          if board else []),
        *(["| `kernels/` | the kernels alone (`kernels.so`, their TIR and arguments), "
           "checked under qemu with `tvm_distx.compiler.rvv.check_kernels` |"]
          if (root / "kernels").is_dir() else []),
        "",
        "Inputs, in order, as global `.npy` files: "
        + (", ".join(f"`{p.name}` {p.dtype}{list(p.shape)}" for p in inputs) or "none"),
        "",
        "```sh",
        *([("./run.sh run " + " ".join(f"-i {p.name}.npy" for p in inputs) + " -o out/"),
           "./run.sh run ... --hostfile hosts.txt   # several boards (host[:slots] per line)",
           "```", "",
           "A board needs python3, python3-numpy, python3-mpi4py and openmpi-bin; no TVM."]
          if board else
          [("./run.sh " + " ".join(f"-i {p.name}.npy" for p in inputs) + " -o out/"),
           "HOSTS=node0,node1 ./run.sh ...   # across hosts, run on node0 (the first)",
           "```", "",
           "Every rank needs Python with tvm-distx, TVM's runtime and mpi4py for its "
           "machine."]),
    ]
    (root / "README.md").write_text("\n".join(lines) + "\n")


def _example_shape(spec, meshes: dict[str, DeviceMesh]) -> tuple[int, ...]:
    """A shape that fits ``spec``: a symbolic dimension gets a size every mesh divides."""
    size = math.lcm(*(m.size for m in meshes.values())) if meshes else 1
    return tuple(size if isinstance(d, str) else d for d in spec.shape)


def _coordinates(meshes: dict[str, DeviceMesh], rank: int) -> dict[str, list[int]]:
    out = {}
    for name, mesh in meshes.items():
        if rank in mesh.device_range:
            coord = np.unravel_index(rank - mesh.device_range.start, mesh.shape)
            out[name] = [int(c) for c in coord]
    return out


def _process_groups(meshes: dict[str, DeviceMesh]) -> list[dict]:
    groups = []
    for name, mesh in meshes.items():
        for axis in range(mesh.ndim):
            group = ccl.CollectiveGroup.along(mesh, (axis,))
            groups.append({"mesh": name, "axis": axis,
                           "groups": [list(g) for g in group.all_groups()]})
    return groups


def _collectives(mod: tvm.IRModule) -> set[str]:
    found: set[str] = set()

    def visit(expr):
        if isinstance(expr, relax.ExternFunc) and expr.global_symbol.startswith("tvm_distx.ccl."):
            found.add(str(expr.global_symbol))

    for _, func in _ir.relax_functions(mod):
        relax.analysis.post_order_visit(func, visit)
    return found
