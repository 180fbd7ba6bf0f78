"""The main job, as run by ``scripts/demo``.

Read the seed example (``tests/data/seed_pipeline.py``: ``main`` calls the
private ``mlp`` twice), annotate it with :class:`tvm_distx.passes.AnnotateSharding`
so that the first call runs on ``mesh[0]`` and the second on ``mesh[1]`` (a
two-stage pipeline), propagate the shardings through the calls with
:class:`tvm_distx.passes.PropagateSharding`, and print the annotated module, the
propagated module and the sharding table of :func:`tvm_distx.reports.explain`. Then do the
same for the tensor-parallel variant (the README's tour: ``A`` split by columns, ``B`` by
rows), lower it to rank programs and run it on two emulated ranks against numpy. Each
section starts with a few ``#`` lines saying what a newcomer is looking at, and the output
ends with where to go next.
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
#: tensor parallelism (A split by columns, B by rows) inside mlp, as in the README's tour.
EXAMPLES = {
    "seed_pipeline.py": [
        ShardingRule(callee="mlp", args={0: "R"}, meshes=["mesh[0]", "mesh[1]"]),
    ],
    "seed_tensor_parallel.py": [
        ShardingRule(param="A", result="S[1]", function="mlp"),
        ShardingRule(param="B", result="S[0]", function="mlp"),
    ],
}

#: What a newcomer sees in each section of each example, printed as ``#`` lines under the
#: section's title. tests/cli/test_demo.py checks that every name a note mentions is in the
#: section it explains.
NOTES = {
    "seed_pipeline.py": {
        "annotated": [
            "the rule: the two calls of mlp run on mesh[0] and mesh[1] (one rank each), each",
            "with its input replicated (R): a pipeline of two stages; x_ann and y_ann mark them",
        ],
        "propagated": [
            "every value now has a type R.DTensor(shape, dtype, mesh, placement);",
            "mlp_1 is mlp's copy for mesh[1], the second stage;",
            "y_ann, A_redist and B_redist are redistributions propagation added: the second",
            "stage needs the first stage's result y and its own copies of the weights A and B,",
            "which main receives on mesh[0], so each is sent to mesh[1] (a send/recv when lowered)",
        ],
        "explained": [
            "one table per function: each value's mesh, placement, local shape and why",
        ],
    },
    "seed_tensor_parallel.py": {
        "annotated": [
            "the rules: A split by columns (S[1]) and B by rows (S[0]) on the 2 ranks of mesh[0],",
            "Megatron's tensor parallelism; each rank holds half of each weight",
        ],
        "propagated": [
            "relu(x @ A) stays split by columns (S[1]); the second matmul gives each rank a",
            "partial sum (P) that one all-reduce completes, so each mlp returns a replicated (R) value",
        ],
        "explained": [
            "local shape: what each rank holds, (128, 64) for A; lv2 is the partial sum (P)",
        ],
    },
}

#: The last section: where a newcomer goes from here.
WHAT_NEXT = [
    "the five-minute tour, README.md: the same MLP compiled and run on two MPI ranks, from",
    "  Python and with tvm-distx explain / plan / compile / run",
    "the tutorials, tutorials/README.md: five notebooks (pipelines, meshes, PyTorch, RISC-V,",
    "  a Hugging Face LLM); scripts/demo --full installs what they need",
    "the command line, docs/cli.md: a session as it ran, and every subcommand",
    "the user guide, docs/index.md",
]


def _write(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    """Annotate the seed examples and print them; returns the exit code."""
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the seed examples")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    _write("# tvm-distx demo: two small programs from tests/data, each annotated with a few rules,")
    _write("# propagated (every value gets a placement) and explained; then the second runs on two")
    _write("# emulated ranks. Placements: R replicated (every rank holds it all), S[k] split along")
    _write("# dimension k, P a partial sum that a reduction across the ranks completes.")
    for filename, rules in EXAMPLES.items():
        path = args.data / filename
        mod = load_module(path)
        annotated = AnnotateSharding(rules)(mod)
        notes = NOTES[filename]
        _write(f"# ---- {path}: annotated by")
        for rule in rules:
            _write(f"#   {rule!r}")
        _notes(notes["annotated"])
        _write(annotated.script(show_meta=False))
        _write(f"# ---- {path}: propagated")
        _notes(notes["propagated"])
        # the high-level view, to read (compile legalizes before it propagates)
        _write(PropagateSharding(warn_unlegalized=False)(annotated).script(show_meta=False))
        _write(f"# ---- {path}: why each value is sharded so")
        _notes(notes["explained"])
        _write(str(explain(annotated)))
    _write("# ---- tensor-parallel MLP on 2 emulated ranks")
    _notes(["each rank runs its own program on its shards (threads of this process here);",
            "the result equals numpy's on the whole arrays"])
    _write(_run_tensor_parallel(args.data / "seed_tensor_parallel.py"))
    _write("# ---- what next")
    for line in WHAT_NEXT:
        _write(line)
    return 0


def _notes(lines: list[str]) -> None:
    for line in lines:
        _write(f"# > {line}")


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
