"""One rank of a persistent session: ``python -m tvm_distx.runtime.session_worker BUNDLE SOCKET DIR``.

:class:`tvm_distx.runtime.session.MPISession` starts one per rank under
``mpiexec``, once. Each rank then:

1. checks the bundle and its own weight files, installs the MPI collectives
   and creates its virtual machine (once);
2. reports its process id; rank 0 connects to the driver's socket and says
   ``ready`` with every rank's id;
3. serves calls until ``close``: rank 0 receives a call (function, the global
   values of the run-time inputs, the symbolic sizes, the *state*) and
   broadcasts it; every rank runs its entry on its shards, with its stored
   weights loaded from the bundle the first time a function needs them and
   kept; rank 0 gathers the result blocks and sends the global results back.
   State is values that stay on the ranks: a call may take a parameter from a
   named resident value (zeros of the rank's shard the first time) and keep a
   result under a name instead of returning it (a key-value cache, say), so
   that no byte of it moves.

A rank that fails writes its traceback to ``DIR/rank<r>.error`` and aborts the
job (``MPI.COMM_WORLD.Abort``): the session is over, and the driver names the
rank. Messages are length-prefixed pickles on a Unix socket that only the
driver's user can reach (the session directory is private).
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import struct
import sys
import traceback
from pathlib import Path

import numpy as np

__all__ = ["send_message", "receive_message", "serve", "RankState", "assemble_reply"]

_HEADER = struct.Struct("!Q")


def send_message(conn: socket.socket, message) -> None:
    """Send one length-prefixed pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(_HEADER.pack(len(data)) + data)


def receive_message(conn: socket.socket):
    """Receive one length-prefixed pickle; ``None`` when the peer has closed."""
    header = _read(conn, _HEADER.size)
    if header is None:
        return None
    data = _read(conn, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _read(conn: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 22))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve(bundle: Path, address: str, folder: Path) -> None:
    """Serve calls until the driver says ``close`` (see the module documentation)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        _serve(bundle, address, comm, rank)
    except BaseException:  # any failure ends the session, with the reason on disk
        text = traceback.format_exc()
        (folder / f"rank{rank}.error").write_text(text)
        sys.stderr.write(f"[tvm_distx] rank {rank} failed:\n{text}")
        sys.stderr.flush()
        comm.Abort(1)


def _serve(bundle: Path, address: str, comm, rank: int) -> None:
    import tvm
    from tvm import relax

    from tvm_distx.bundle.manifest import check_weights, read_manifest
    from tvm_distx.errors import BundleError
    from tvm_distx.runtime import mpi_ccl
    from tvm_distx.runtime.worker import _threads_per_rank

    _threads_per_rank(comm)
    manifest = read_manifest(bundle)
    if comm.Get_size() != manifest.num_ranks:
        raise BundleError(f"the bundle needs {manifest.num_ranks} ranks, the session has "
                          f"{comm.Get_size()}")
    check_weights(manifest, [rank])
    mpi_ccl.install(comm)  # before the VM exists: it resolves functions once
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(manifest.library_path)), tvm.cpu())
    me = RankState(manifest, rank, vm)

    conn = None
    ranks = comm.gather((rank, os.getpid(), socket.gethostname()), root=0)
    if rank == 0:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(address)
        send_message(conn, ("ready", ranks))
    while True:
        call = receive_message(conn) if rank == 0 else None
        call = comm.bcast(call if call is not None else ("close",), root=0)
        if call[0] == "close":
            break
        _, function, values, sizes, state, keep = call
        blocks = me.call(function, values, sizes, state, keep)
        gathered = comm.gather((rank, blocks, len(me.loaded)), root=0)
        if rank == 0:
            result = assemble_reply(manifest, function, sizes, keep,
                                    {r: b for r, b, _ in gathered})
            send_message(conn, ("ok", result, {r: n for r, _, n in gathered}))
    if conn is not None:
        conn.close()


class RankState:
    """What one rank of a session keeps between calls, and how it runs one call.

    Every backend's ranks use it (MPI processes, disco workers, emulated
    threads), so a call means the same everywhere.

    Parameters
    ----------
    manifest : tvm_distx.bundle.manifest.Manifest
        The bundle the session serves.
    rank : int
        This rank.
    vm : tvm.relax.VirtualMachine
        The rank's virtual machine over the bundle's library, created once
        (after the backend's collectives are registered).

    Attributes
    ----------
    loaded : dict of str to tvm.runtime.Tensor
        The stored weights this rank has loaded, each the first time a
        function needs it (read only through
        :meth:`tvm_distx.bundle.manifest.Manifest.read_weight`).
    resident : dict of str to tvm.runtime.Tensor
        The values kept on this rank between calls, by name (``state``/``keep``).
    """

    def __init__(self, manifest, rank: int, vm) -> None:
        self.manifest, self.rank, self.vm = manifest, rank, vm
        self.loaded: dict[str, object] = {}
        self.resident: dict[str, object] = {}

    def call(self, function: str, values: dict, sizes: dict, state: dict, keep: dict,
             local: bool = False) -> dict[int, np.ndarray]:
        """Run this rank's entry of ``function``; returns the result blocks it reports.

        Parameters
        ----------
        function : str
            The public function.
        values : dict of str to numpy.ndarray
            The run-time parameters by name: global values, cut here, or (with
            ``local``) this rank's shards already.
        sizes : dict
            The call's symbolic sizes.
        state, keep : dict
            As for :meth:`tvm_distx.runtime.session.MPISession.run`.
        local : bool
            Whether ``values`` are this rank's shards.

        Returns
        -------
        dict of int to numpy.ndarray
            Per result index not kept, this rank's block when it is the first
            holder of that block (each block is reported by one rank).
        """
        import tvm

        from tvm_distx.layout.arrays import first_holder

        manifest, rank = self.manifest, self.rank
        signature = manifest.function(function)
        if signature.symbolic:
            signature = signature.specialize(sizes)
        stored = set(manifest.weights.get(function, ()))
        blocks: dict[int, np.ndarray] = {}
        entry = manifest.entry(function, rank)
        if entry is None:
            return blocks
        args = []
        for spec in signature.params:
            if not spec.held_by(rank):
                continue
            if spec.name in state:  # a value kept on the ranks by an earlier call
                name = state[spec.name]
                if name not in self.resident:  # first use: zeros of this rank's shard
                    self.resident[name] = tvm.runtime.tensor(
                        np.zeros(spec.sharding.local_shape(spec.shape), spec.dtype))
                args.append(self.resident[name])
            elif spec.name in stored:
                if spec.name not in self.loaded:
                    self.loaded[spec.name] = tvm.runtime.tensor(np.ascontiguousarray(
                        manifest.read_weight(rank, spec.name)
                        if signature.fed(spec, rank)  # else TVM's feed: a placeholder
                        else signature.rank_input(spec, None, rank)))
                args.append(self.loaded[spec.name])
            else:
                value = values.get(spec.name)
                if not local:  # the global value: what this rank takes of it
                    value = signature.rank_input(spec, value, rank)
                args.append(tvm.runtime.tensor(np.ascontiguousarray(value)))
        out = self.vm[entry](*args)
        results = list(out) if signature.tuple_result else [out]
        held = [spec for spec in signature.results if spec.held_by(rank)]
        for index, spec in enumerate(signature.results):
            if not spec.held_by(rank):
                continue
            if index in keep:  # stays on this rank, as it is: nothing moves
                self.resident[keep[index]] = results[held.index(spec)]
            elif first_holder(spec.sharding, spec.shape, rank):
                blocks[index] = results[held.index(spec)].numpy()
        return blocks


def assemble_reply(manifest, function: str, sizes: dict, keep: dict,
                   blocks: dict[int, dict[int, np.ndarray]]):
    """The global results of a call from every rank's blocks (:meth:`RankState.call`).

    Returns the results not kept, in order: a tuple for a tuple-returning
    function, else the one array.
    """
    from tvm_distx.layout.arrays import assemble_array

    signature = manifest.function(function)
    if signature.symbolic:
        signature = signature.specialize(sizes)
    outputs = []
    for index, spec in enumerate(signature.results):
        if index in keep:
            continue
        shards = {r: b[index] for r, b in blocks.items() if index in b}
        outputs.append(assemble_array(shards, spec.sharding, spec.shape))
    return tuple(outputs) if signature.tuple_result else outputs[0]


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve this rank."""
    parser = argparse.ArgumentParser(prog="python -m tvm_distx.runtime.session_worker",
                                     description="One rank of a tvm-distx session (started by "
                                     "MPISession under mpiexec).")
    parser.add_argument("bundle", type=Path)
    parser.add_argument("address")
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    serve(args.bundle, args.address, args.folder)


if __name__ == "__main__":
    main()
