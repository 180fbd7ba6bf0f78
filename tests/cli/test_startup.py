"""The subcommands that never hand TVM a PyTorch tensor import TVM without PyTorch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
from locations import REPO_ROOT

SEED = REPO_ROOT / "tests" / "data" / "seed_tensor_parallel.py"
RULES = [{"param": "A", "result": "S[1]", "function": "mlp"},
         {"param": "B", "result": "S[0]", "function": "mlp"}]

PROBE = """
import sys
from tvm_distx.cli.main import main
code = main({argv!r})
loaded = "torch" in sys.modules
import torch  # still importable afterwards, for whatever needs it
print("EXIT", code, "TORCH_LOADED_BY_THE_COMMAND", loaded, "TORCH", torch.__name__)
"""


def probe(argv: list[str], cwd) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()[-1]


def test_explain_runs_without_torch_and_torch_stays_importable(tmp_path):
    shutil.copy(SEED, tmp_path / "model.py")
    (tmp_path / "rules.json").write_text(json.dumps(RULES))
    line = probe(["explain", "model.py", "--rules", "rules.json"], tmp_path)
    assert line == "EXIT 0 TORCH_LOADED_BY_THE_COMMAND False TORCH torch", line


def test_compile_and_run_build_and_launch_without_torch(tmp_path):
    """Building a bundle and running it on 2 MPI ranks need nothing of PyTorch."""
    shutil.copy(SEED, tmp_path / "model.py")
    (tmp_path / "rules.json").write_text(json.dumps(RULES))
    rng = np.random.default_rng(0)
    A, B, x = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    np.savez(tmp_path / "weights.npz", A=A, B=B)
    np.save(tmp_path / "x.npy", x)
    line = probe(["compile", "model.py", "--rules", "rules.json", "--weights", "weights.npz",
                  "-o", "bundle"], tmp_path)
    assert line == "EXIT 0 TORCH_LOADED_BY_THE_COMMAND False TORCH torch", line
    line = probe(["run", "bundle", "-i", "x.npy", "-o", "out"], tmp_path)
    assert line == "EXIT 0 TORCH_LOADED_BY_THE_COMMAND False TORCH torch", line
    mlp = lambda v: np.maximum(v @ A, 0) @ B  # noqa: E731
    np.testing.assert_allclose(np.load(tmp_path / "out" / "out0.npy"), mlp(mlp(x)),
                               rtol=1e-4, atol=1e-5)

