"""Whether the RISC-V toolchain is here: a skip outside CI, a failure in CI.

scripts/test installs gcc-riscv64-linux-gnu and qemu-user when they are missing,
so in CI (``CI`` set) a missing tool means the set-up is broken.
"""

from __future__ import annotations

import os
import shutil

import pytest

TOOLS = ("riscv64-linux-gnu-gcc", "qemu-riscv64")


def missing_tools() -> list[str]:
    """The tools of :data:`TOOLS` not on ``PATH``."""
    return [t for t in TOOLS if shutil.which(t) is None]


def require_tools() -> None:
    """Skip the calling test (outside CI) or fail it (in CI) if a tool is missing."""
    missing = missing_tools()
    if missing and os.environ.get("CI"):
        pytest.fail(f"{', '.join(missing)} missing in CI: scripts/test should have installed "
                    "them", pytrace=False)
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (outside CI)", allow_module_level=True)
