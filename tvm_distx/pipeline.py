"""``distribute``: from an annotated global-view module to the rank-local program.

The stages run in the only order that gives right numbers with the pinned TVM
(``../shared/NOTES-tvm.md``): ``LegalizeOps`` *before* propagation, because it
skips every operator whose operands are DTensors, and a row-parallel matmul
legalized afterwards silently loses its all-reduce.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import tvm
from tvm import relax

__all__ = ["STAGES", "distribute", "run_stages"]

logger = logging.getLogger(__name__)


def _stages():
    from tvm_distx.legalize import LegalizeRedistribute, LowerDistIR, LowerGlobalViewToLocalView
    from tvm_distx.passes import PropagateSharding

    return [
        ("legalize_ops", relax.transform.LegalizeOps()),
        ("propagate_sharding", PropagateSharding(require_legalized=True)),
        ("local_view", LowerGlobalViewToLocalView()),
        ("legalize_redistribute", LegalizeRedistribute()),
        ("lower_distir", LowerDistIR()),
    ]


#: The stage names, in order (also the file names under ``dump_dir``).
STAGES = ("legalize_ops", "propagate_sharding", "local_view", "legalize_redistribute",
          "lower_distir")


def distribute(mod: tvm.IRModule, *, dump_dir: str | os.PathLike | None = None) -> tvm.IRModule:
    """Lower an annotated module to the program every rank runs.

    Parameters
    ----------
    mod : tvm.IRModule
        A global-view module with ``R.dist.annotate_sharding`` calls (see
        :class:`tvm_distx.passes.AnnotateSharding`) and its meshes in
        ``global_infos``.
    dump_dir : path, optional
        Write the module after every stage there, as ``NN_<stage>.py`` TVMScript
        (``00_input.py`` first), for debugging.

    Returns
    -------
    tvm.IRModule
        The rank-local module: every tensor has its local shape, and
        communication is ``tvm_distx.ccl.*`` calls. A function spanning
        several meshes has one version per rank set; see
        :func:`tvm_distx.legalize.lower_distir.rank_entry`.

    Raises
    ------
    ShardingError
        From any stage, naming the function and the value.
    """
    return run_stages(mod, dump_dir=dump_dir)[STAGES[-1]]


def run_stages(mod: tvm.IRModule, *,
               dump_dir: str | os.PathLike | None = None) -> dict[str, tvm.IRModule]:
    """Run every stage of :func:`distribute`; returns the module after each, by stage name."""
    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "00_input.py").write_text(mod.script(show_meta=False))
    out = {}
    for index, (name, stage) in enumerate(_stages(), start=1):
        mod = stage(mod)
        out[name] = mod
        logger.debug("distribute: %s done", name)
        if dump is not None:
            (dump / f"{index:02d}_{name}.py").write_text(mod.script(show_meta=False))
    return out
