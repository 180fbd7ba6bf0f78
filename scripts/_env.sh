# Shared set-up for scripts/test and scripts/demo (sourced, not run).
# Creates or reuses .venv at the repository root and installs the package with
# its test dependencies. Nothing has to be installed by hand.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi

# Reinstall only when the project's requirements changed since the last install.
STAMP="$VENV/.tvm_distx-installed"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] \
        || ! "$VENV/bin/python" -c "import tvm_distx, tvm, mpi4py, torch, transformers, pytest" >/dev/null 2>&1; then
    echo "[setup] installing tvm-distx and its dependencies into $VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # torch==2.13.0 is the local CPU build (see pyproject.toml).
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test]"
    echo "$WANT" > "$STAMP"
fi

export PATH="$VENV/bin:$PATH"

# The RISC-V cross compiler and qemu user-mode emulation, for RVV bundles checked under
# qemu (Debian packages, installed once when missing).
if ! command -v riscv64-linux-gnu-gcc >/dev/null 2>&1 || ! command -v qemu-riscv64 >/dev/null 2>&1; then
    echo "[setup] installing gcc-riscv64-linux-gnu and qemu-user with apt-get"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc-riscv64-linux-gnu qemu-user >/dev/null
fi
