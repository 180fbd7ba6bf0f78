"""tvm-distx: make Apache TVM Relax's distributed IR usable on real programs.

The sharding vocabulary lives at the top level; passes live in
:mod:`tvm_distx.passes` and redistribution legalization in
:mod:`tvm_distx.legalize`.
"""

from .errors import (
    ArgumentError,
    BundleError,
    CallGraphError,
    CollectiveGroupError,
    DistxError,
    LaunchError,
    PeerFailedError,
    UnsupportedProgramError,
    IndivisibleShardError,
    MeshError,
    PlacementRankError,
    PlacementSyntaxError,
    RuleError,
    ShardDimError,
    ShardingConflictError,
    ShardingError,
    UnknownMeshError,
    UnmatchedRuleError,
    UnsupportedValueError,
)
from .mesh import DeviceMesh, MeshRef, module_meshes
from .placement import Placement, Replicate, Shard
from .rules import ShardingRule
from .script import load_module
from .explain import explain
from .pipeline import distribute
from .executable import DistExecutable, compile
from .comm_report import comm_report

__version__ = "0.1.0"

__all__ = [
    "DeviceMesh",
    "MeshRef",
    "module_meshes",
    "Placement",
    "Replicate",
    "Shard",
    "ShardingRule",
    "load_module",
    "explain",
    "distribute",
    "compile",
    "DistExecutable",
    "comm_report",
    "DistxError",
    "BundleError",
    "ArgumentError",
    "LaunchError",
    "CollectiveGroupError",
    "PeerFailedError",
    "ShardingError",
    "PlacementSyntaxError",
    "PlacementRankError",
    "ShardDimError",
    "IndivisibleShardError",
    "MeshError",
    "UnknownMeshError",
    "ShardingConflictError",
    "RuleError",
    "UnmatchedRuleError",
    "UnsupportedValueError",
    "CallGraphError",
    "UnsupportedProgramError",
]
