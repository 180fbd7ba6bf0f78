"""The package installs with its subpackage mapping, editable or not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_regular_install_maps_passes_and_legalize(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(ROOT)],
        check=True,
        cwd=tmp_path,
    )
    installed = target / "tvm_distx"
    # every module of the checkout installs where its import name says (a subpackage left out
    # of pyproject.toml's list would be missing here), and the RVV harness source ships too
    for folder, dest in (("tvm_distx", installed), ("passes", installed / "passes"),
                         ("legalize", installed / "legalize")):
        for source in (ROOT / folder).rglob("*.py"):
            relative = source.relative_to(ROOT / folder)
            assert (dest / relative).is_file(), f"{folder}/{relative} is not installed"
    assert (installed / "compiler" / "rvv_harness.c").is_file()
    assert not (target / "passes").exists(), "passes/ must not install as a top-level package"
    probe = (
        "import tvm_distx, tvm_distx.passes, tvm_distx.legalize;"
        "print(tvm_distx.__file__); print(tvm_distx.passes.AnnotateSharding.__module__)"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True,
        cwd=tmp_path, env=env,
    ).stdout.splitlines()
    assert out[0].startswith(str(installed))
    assert out[1] == "tvm_distx.passes.annotate_sharding"


def test_development_install_imports_from_the_checkout():
    import tvm_distx.passes

    assert Path(tvm_distx.passes.__file__).resolve() == ROOT / "passes" / "__init__.py"


def test_no_bare_imports_of_passes_or_legalize():
    offenders = []
    for path in ROOT.glob("**/*.py"):
        if ".venv" in path.parts:
            continue
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import passes", "from passes", "import legalize",
                                    "from legalize")):
                offenders.append(f"{path.relative_to(ROOT)}: {stripped}")
    assert offenders == []
