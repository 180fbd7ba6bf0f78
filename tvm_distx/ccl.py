"""The communication ABI of lowered programs: the ``tvm_distx.ccl.*`` runtime functions.

:class:`tvm_distx.legalize.LegalizeRedistribute` and
:class:`tvm_distx.legalize.LowerDistIR` write calls of runtime functions whose
names start with ``tvm_distx.ccl.``; every backend (the emulated ranks of
:mod:`tvm_distx.runtime.emulated`, the MPI and disco ranks) registers an
implementation of each under that name, through the one adapter of
:mod:`tvm_distx.runtime.collectives`. This module is the contract between
the two sides: the names and the order of the arguments. How the integer
arguments are encoded is :mod:`tvm_distx.layout.abi` (re-exported here). It
imports no TVM and no compiler module.

All but ``send`` and ``recv_sized`` are destination-passing (``R.call_dps_packed``): the output
buffer comes last and is allocated by the caller with the rank-local shape.

=============================== ================================== =================================
function                        arguments (then the output buffer) what the rank does
=============================== ================================== =================================
``tvm_distx.ccl.allreduce``     ``x, kind, group``                 reduce ``x`` over its group
``tvm_distx.ccl.allgather``     ``x, group, (dim,)``               concatenate the group's blocks
                                                                   along ``dim``
``tvm_distx.ccl.reducescatter`` ``x, kind, group, (dim,)``         reduce ``x`` over its group;
                                                                   member ``k`` keeps block ``k`` of
                                                                   the result along ``dim``
``tvm_distx.ccl.alltoall``      ``x, group, (split, concat)``      split ``x`` along ``split``, send
                                                                   piece ``k`` to member ``k``,
                                                                   concatenate along ``concat``
``tvm_distx.ccl.broadcast``     ``x, group, (root,)``              member ``root``'s ``x``, on every
                                                                   member (the others' ``x`` is not
                                                                   read)
``tvm_distx.ccl.local_slice``   ``x, group, (dim,)``               keep its piece of ``x`` along
                                                                   ``dim`` (no traffic)
``tvm_distx.ccl.send_recv``     ``x, spec``                        a rank of both meshes of a
                                                                   :class:`SendRecvSpec`
``tvm_distx.ccl.send``          ``x, spec`` (no output; impure)    a rank of the source mesh only
``tvm_distx.ccl.recv``          ``spec``                           a rank of the destination mesh
                                                                   only
``tvm_distx.ccl.recv_sized``    ``spec, dtype`` (not destination-  a rank of the destination mesh
                                passing: returns a new tensor)     only, for a spec with run-time
                                                                   extents (its shape comes first)
=============================== ================================== =================================

``group`` is a :class:`CollectiveGroup`, ``spec`` a :class:`SendRecvSpec` and
``kind`` one of :data:`REDUCE_KINDS`, each passed as a shape (a tuple of
integers). A collective is called by every member of its group, in the same
order on every member, and reductions fold the members' values in member
order (the same bits on every backend); a send/recv is called by every device
of either mesh. Ranks that take part in no step of a call do not call it.

TVM's own lowering (``tvm.relax.distributed.transform.LowerDistIR``, then
``LegalizeOps``) calls TVM's disco builtins instead, :data:`DISCO_BUILTINS`
under the prefix :data:`DISCO_PREFIX`. An MPI rank provides them over the whole
MPI world, worker ``k`` being rank ``k`` (see
:mod:`tvm_distx.runtime.mpi_ccl`):

==================================== ================================ ============================
function                             arguments (then the output)      what the rank does
==================================== ================================ ============================
``runtime.disco.allreduce``          ``x, (kind,), in_group``         reduce ``x`` over the world
``runtime.disco.allgather``          ``x, in_group``                  concatenate every rank's
                                                                      ``x`` along dimension 0
``runtime.disco.broadcast_from_``    ``x, in_group``                  rank 0's ``x`` (the others'
``worker0``                                                           is not read)
``runtime.disco.scatter_from_``      ``x, in_group``                  row ``k`` of rank 0's ``x``
``worker0``                                                           (``(world, *out.shape)``)
                                                                      on rank ``k``
``runtime.disco.gather_to_worker0``  ``x, in_group``                  every rank's ``x`` along
                                                                      dimension 0, on rank 0
``runtime.disco.worker_id``          none; returns a shape            ``(rank,)``
==================================== ================================ ============================

``in_group`` is ignored: every rank of the world is one group, as in a disco
session without worker groups.
"""

from __future__ import annotations

from tvm_distx.layout.abi import RUN_TIME, CollectiveGroup, Piece, SendRecvSpec

__all__ = [
    "ALLREDUCE",
    "ALLGATHER",
    "REDUCE_SCATTER",
    "BROADCAST",
    "ALLTOALL",
    "LOCAL_SLICE",
    "SEND_RECV",
    "SEND",
    "RECV",
    "RECV_SIZED",
    "RUN_TIME",
    "FUNCTIONS",
    "DISCO_PREFIX",
    "DISCO_BUILTINS",
    "REDUCE_KINDS",
    "CollectiveGroup",
    "SendRecvSpec",
    "Piece",
]

ALLREDUCE = "tvm_distx.ccl.allreduce"
ALLGATHER = "tvm_distx.ccl.allgather"
REDUCE_SCATTER = "tvm_distx.ccl.reducescatter"
BROADCAST = "tvm_distx.ccl.broadcast"
ALLTOALL = "tvm_distx.ccl.alltoall"
LOCAL_SLICE = "tvm_distx.ccl.local_slice"
SEND_RECV = "tvm_distx.ccl.send_recv"
SEND = "tvm_distx.ccl.send"
RECV = "tvm_distx.ccl.recv"
RECV_SIZED = "tvm_distx.ccl.recv_sized"

#: Every runtime function a lowered program may call.
FUNCTIONS = (ALLREDUCE, ALLGATHER, REDUCE_SCATTER, ALLTOALL, BROADCAST, LOCAL_SLICE, SEND_RECV,
             SEND, RECV, RECV_SIZED)

#: The prefix of TVM's disco builtins (TVM's dispatchers to a disco session's CCL).
DISCO_PREFIX = "runtime.disco."

#: TVM's disco builtins that TVM's lowered programs call, without :data:`DISCO_PREFIX`.
DISCO_BUILTINS = ("allreduce", "allgather", "broadcast_from_worker0", "scatter_from_worker0",
                  "gather_to_worker0", "worker_id")

#: Reduction kinds, as ``tvm_distx.ccl.allreduce`` and ``reducescatter`` receive them.
REDUCE_KINDS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}
