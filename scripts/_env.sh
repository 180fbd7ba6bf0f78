# Shared set-up for scripts/test and scripts/demo (sourced, not run).
# Creates or reuses .venv at the repository root and installs the package with
# the extras the caller names in DISTX_EXTRAS ("" for the demo, "test" for the
# tests and for `scripts/demo --full`). Nothing has to be installed by hand.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
EXTRAS="${DISTX_EXTRAS:-}"
case "$EXTRAS" in
    test) NEEDED="tvm_distx, tvm, mpi4py, torch, transformers, pytest" ;;
    *) NEEDED="tvm_distx, tvm, mpi4py" ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi

# Reinstall only when the project's requirements (or the extras asked for) changed since
# the last install; an install with the test extra also serves the demo.
STAMP="$VENV/.tvm_distx-installed"
WANT="$( (cat "$ROOT/pyproject.toml"; echo "extras=$EXTRAS") | sha256sum | cut -d' ' -f1)"
WANT_TEST="$( (cat "$ROOT/pyproject.toml"; echo "extras=test") | sha256sum | cut -d' ' -f1)"
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
if { [ "$HAVE" != "$WANT" ] && [ "$HAVE" != "$WANT_TEST" ]; } \
        || ! "$VENV/bin/python" -c "import $NEEDED" >/dev/null 2>&1; then
    if [ -n "$EXTRAS" ]; then
        echo "[setup] installing tvm-distx[$EXTRAS] into $VENV (the first time: TVM, numpy," \
             "MPICH, PyTorch CPU and transformers, about 2 GB, a few minutes)"
        SPEC="$ROOT[$EXTRAS]"
    else
        echo "[setup] installing tvm-distx into $VENV (the first time: TVM, numpy and MPICH," \
             "about 600 MB, one or two minutes)"
        SPEC="$ROOT"
    fi
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # torch==2.13.0 is the local CPU build (see pyproject.toml).
    "$VENV/bin/python" -m pip install --quiet -e "$SPEC"
    echo "$WANT" > "$STAMP"
fi

export PATH="$VENV/bin:$PATH"

# The tests check RVV bundles under qemu: the RISC-V cross compiler and qemu user-mode
# emulation (Debian packages, installed once when missing).
if [ "$EXTRAS" = test ] && { ! command -v riscv64-linux-gnu-gcc >/dev/null 2>&1 \
        || ! command -v qemu-riscv64 >/dev/null 2>&1; }; then
    echo "[setup] installing gcc-riscv64-linux-gnu and qemu-user with apt-get"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc-riscv64-linux-gnu qemu-user >/dev/null
fi

# The serving guide's examples are curl commands, run by the tests against a live server.
if [ "$EXTRAS" = test ] && ! command -v curl >/dev/null 2>&1; then
    echo "[setup] installing curl with apt-get"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq curl >/dev/null
fi

# The tests across hosts make test hosts in namespaces (scripts/testhosts): ip (iproute2),
# nsenter and unshare (util-linux), installed once when missing.
if [ "$EXTRAS" = test ] && { ! command -v ip >/dev/null 2>&1 \
        || ! command -v nsenter >/dev/null 2>&1 || ! command -v unshare >/dev/null 2>&1; }; then
    echo "[setup] installing iproute2 and util-linux with apt-get"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq iproute2 util-linux >/dev/null
fi
