"""Sharding geometry: the one home of meshes, placements, shapes, bounds and encodings.

Everything that says where the elements of a sharded tensor live is here, and
only here:

========================================  ===================================================
module                                    owns
========================================  ===================================================
:mod:`~tvm_distx.layout.placement`        ``Replicate``, ``Shard``, ``Partial``, ``Placement``:
                                          the per-axis vocabulary and its text form
:mod:`~tvm_distx.layout.sharding`         ``TensorSharding`` (checked at construction), its
                                          local shape; ``UNKNOWN``, ``replicated``
:mod:`~tvm_distx.layout.mesh_table`           ``MeshTable``: a module's meshes by identity
:mod:`~tvm_distx.layout.geometry`         placement codes, each device's box
                                          (``shard_bounds``), the copies between two
                                          shardings (``send_recv_transfers``)
:mod:`~tvm_distx.layout.abi`              the runtime ABI's integer encodings:
                                          ``CollectiveGroup``, ``SendRecvSpec``, ``Piece``
:mod:`~tvm_distx.layout.derived`          ``DerivedParam``, ``Derivations``: a parameter
                                          cut from a user's weight (a fused projection's
                                          segment), and cutting it from the weights
========================================  ===================================================

The package imports no TVM at import time and no compiler module
(``tvm_distx.passes``, ``tvm_distx.legalize``) ever: rank processes use it.
:class:`~tvm_distx.DeviceMesh` itself lives in :mod:`tvm_distx.layout.mesh`.
"""

from tvm_distx.layout.mesh import DeviceMesh, MeshReference, device_meshes, set_device_meshes
from tvm_distx.layout.abi import CollectiveGroup, Piece, SendRecvSpec
from tvm_distx.layout.derived import BlockOffsets, DerivedParam, Derivations
from tvm_distx.layout.geometry import (
    PARTIAL,
    REPLICATE,
    Transfer,
    decode_placement,
    device_boxes,
    encode_placement,
    send_recv_transfers,
    shard_bounds,
)
from tvm_distx.layout.mesh_table import MeshTable
from tvm_distx.layout.placement import Partial, Placement, PlacementLike, Replicate, Shard, as_placement
from tvm_distx.layout.sharding import UNKNOWN, Sharding, TensorSharding, Unknown, replicated

__all__ = [
    "DeviceMesh",
    "MeshReference",
    "device_meshes",
    "set_device_meshes",
    "MeshTable",
    "Replicate",
    "Shard",
    "Partial",
    "Placement",
    "PlacementLike",
    "as_placement",
    "TensorSharding",
    "Sharding",
    "Unknown",
    "UNKNOWN",
    "replicated",
    "REPLICATE",
    "PARTIAL",
    "encode_placement",
    "decode_placement",
    "device_boxes",
    "shard_bounds",
    "Transfer",
    "send_recv_transfers",
    "CollectiveGroup",
    "SendRecvSpec",
    "Piece",
    "BlockOffsets",
    "DerivedParam",
    "Derivations",
]
