"""The main job, as run by ``scripts/demo``.

Read the seed example (``tests/data/seed_pipeline.py``: ``main`` calls the
private ``mlp`` twice), annotate it with :class:`tvm_distx.passes.AnnotateSharding`
so that the first call runs on ``mesh[0]`` and the second on ``mesh[1]`` (a
two-stage pipeline), propagate the shardings through the calls with
:class:`tvm_distx.passes.PropagateSharding`, and print the annotated module, the
propagated module and the sharding table of :func:`tvm_distx.explain`. Then do the
same for the tensor-parallel variant. Later stages of the project (lowering,
running on ranks) extend this job.
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
        _write(PropagateSharding()(annotated).script(show_meta=False))
        _write(f"# ---- {path}: why each value is sharded so")
        _write(str(explain(annotated)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
