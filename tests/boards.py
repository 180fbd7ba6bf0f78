"""Emulated RISC-V boards for the tests: the board root, built once a run (support module).

The session fixture ``board_root`` (registered for every test by ``tests/conftest.py``) runs
``scripts/rvv-board build`` once per pytest run, the first time a test asks for it: the root
is made in :data:`BOARD_DIR` (a fixed path, so later runs on the same machine reuse it through
its stamp) or reused at once. ``board_hosts`` is two test hosts that are boards, up for the rest
of the session once a test asks for them (docs/testhosts.md, "Boards on this machine").

A board that cannot be made (not root, no apt, no network to Debian's registry) FAILS every test
that asks for it with one line saying why, in CI and outside it; only the opt-out variable
:data:`OPT_OUT` (``TVM_DISTX_NO_BOARD=1``) turns that into a skip, for machines where boards
cannot be made on purpose.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from locations import REPO_ROOT
from testhosts import NamespaceHosts, hosts_up

#: The script that builds the board's root file system.
BOARD = REPO_ROOT / "scripts" / "rvv-board"
#: Where the root is built and cached (the script's default; ``RVV_BOARD_DIR`` moves it).
BOARD_DIR = Path(os.environ.get("RVV_BOARD_DIR", "/var/cache/tvm-distx/rvv-board"))
#: Set to 1 to skip the board tests instead of failing them when no board can be made.
OPT_OUT = "TVM_DISTX_NO_BOARD"
#: How long the first build may take (it took 150 to 225 s on a 2-core machine).
BUILD_TIMEOUT = 1800


def _unavailable(reason: str) -> None:
    """Fail the test: ``reason`` in one line, and how to opt out."""
    pytest.fail(f"no emulated board: {reason} ({OPT_OUT}=1 skips the board tests instead)",
                pytrace=False)


@pytest.fixture(scope="session")
def board_root() -> Path:
    """The board's root file system, made by ``scripts/rvv-board build`` or reused."""
    if os.environ.get(OPT_OUT) == "1":
        pytest.skip(f"the board tests are skipped ({OPT_OUT}=1)")
    if os.geteuid() != 0:
        _unavailable("the board needs root (binfmt_misc, chroot, overlayfs)")
    start = time.monotonic()
    try:
        done = subprocess.run([str(BOARD), "build", str(BOARD_DIR)], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        _unavailable(f"scripts/rvv-board build took over {BUILD_TIMEOUT} s "
                     f"(its log: {BOARD_DIR / 'build.log'})")
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        _unavailable(lines[-1] if lines else f"scripts/rvv-board build exited "
                                             f"{done.returncode}")
    print(f"board root ready in {time.monotonic() - start:.1f} s")
    return Path(done.stdout.strip())


@pytest.fixture(scope="session")
def board_hosts(board_root: Path) -> Iterator[NamespaceHosts]:
    """Two test hosts that are boards, for the rest of the session."""
    with hosts_up(2, root=board_root) as hosts:
        yield hosts
