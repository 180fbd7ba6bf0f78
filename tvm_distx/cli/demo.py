"""The main job, as run by ``scripts/demo``.

Read the seed example (``tests/data/seed_pipeline.py``: ``main`` calls the
private ``mlp`` twice), annotate it with :class:`tvm_distx.passes.AnnotateSharding`
so that the first call runs on ``mesh[0]`` and the second on ``mesh[1]`` (a
two-stage pipeline), propagate the shardings through the calls with
:class:`tvm_distx.passes.PropagateSharding`, and print the annotated module, the
propagated module and the sharding table of :func:`tvm_distx.reports.explain`. Then do the
same for the tensor-parallel variant, lower it to rank programs and run it on two
emulated ranks against numpy. Later stages of the project (redistribution,
pipeline stages, MPI) extend this job.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tvm_distx import ShardingRule, explain, load_module
from tvm_distx.passes import AnnotateSharding, PropagateSharding

logger = logging.getLogger(__name__)

DATA = Path("tests") / "data"

#: The rules of each example: a pipeline over two meshes, and Megatron-style
#: tensor parallelism (A split by columns, B by rows) inside mlp.
EXAMPLES = {
    "seed_pipeline.py": [
        ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"]),
    ],
    "seed_tensor_parallel.py": [
        ShardingRule(param="A", result="S[1]", function="mlp"),
        ShardingRule(param="B", result="S[0]", function="mlp"),
        ShardingRule(callee="mlp", args={0: "R"}, function="main"),
    ],
}


def _write(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    """Annotate the seed examples and print them; returns the exit code."""
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the seed examples")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    for filename, rules in EXAMPLES.items():
        path = args.data / filename
        mod = load_module(path)
        annotated = AnnotateSharding(rules)(mod)
        _write(f"# ---- {path}: annotated by")
        for rule in rules:
            _write(f"#   {rule!r}")
        _write(annotated.script(show_meta=False))
        _write(f"# ---- {path}: propagated")
        # the high-level view, to read (compile legalizes before it propagates)
        _write(PropagateSharding(warn_unlegalized=False)(annotated).script(show_meta=False))
        _write(f"# ---- {path}: why each value is sharded so")
        _write(str(explain(annotated)))
    _write("# ---- tensor-parallel MLP on 2 emulated ranks")
    _write(_run_tensor_parallel(args.data / "seed_tensor_parallel.py"))
    return 0


def _run_tensor_parallel(path: Path) -> str:
    """Lower the tensor-parallel seed example, run it on 2 emulated ranks, compare to numpy."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.distributed import transform as dist_transform

    from tvm_distx.legalize import LowerDistIR
    from tvm_distx.runtime import emulate, shard_array
    from tvm_distx.layout import TensorSharding

    annotated = AnnotateSharding(EXAMPLES["seed_tensor_parallel.py"])(load_module(path))
    dist = PropagateSharding(require_legalized=True)(relax.transform.LegalizeOps()(annotated))
    ranks = LowerDistIR()(dist_transform.LowerGlobalViewToLocalView()(dist))
    exe = tvm.compile(ranks, target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(0)
    x, A, B = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    params = dist["main"].params
    shards = [[shard_array(v, TensorSharding.from_type(p.ty), rank) for v, p in zip((x, A, B), params)]
              for rank in (0, 1)]
    outs = emulate(exe, shards, devices=[0, 1])

    def mlp(v):
        return np.maximum(v @ A, 0) @ B

    want = mlp(mlp(x))
    error = max(float(np.abs(out - want).max()) for out in outs)
    local = ", ".join(f"{p.name} {tuple(int(d) for d in p.ty.shape.values)}"
                      for p in ranks["main"].params)
    return f"rank-local parameters: {local}\nmax |error| against numpy: {error:.3g}"


if __name__ == "__main__":
    sys.exit(main())
