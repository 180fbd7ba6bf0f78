"""Every documented shell command runs as written, in a fresh clone, as a new user runs it.

The ```bash blocks of the README, of every page of ``docs/`` and of ``tutorials/README.md``
are cut into commands (a quoted string, a ``\\`` continuation or a here-document keeps its
lines together). Each command is run here, exactly as written, or is in ``NOT_HERE`` with
the reason and the test that runs it instead; a command in neither fails, so a new command
cannot go untested, and an entry of ``NOT_HERE`` that names no command fails too.

The commands run in a ``git clone`` of this checkout (with its uncommitted changes applied),
page by page in the order a reader meets them: the README's from the clone's root after
``source .venv/bin/activate`` (its Python tour too), the guides' in the ``tour/`` folder the
README's command-line block makes, the tutorials' from the root. The clone's ``.venv`` is
the suite's own environment, seen through a small virtual environment that ``scripts/demo``
accepts as set up (nothing is installed). Afterwards ``git status`` of the clone is what it
was: everything the steps wrote is in ``tour/`` (ignored) or was removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tutorials" / "README.md"]

#: Commands not run here, by page and the start of the command, with the reason (and where
#: they are run instead).
NOT_HERE = {
    ("README.md", "scripts/test"):
        "the whole suite, which runs this test (CI's .ci/run calls it)",
    ("README.md", "pip install -e"):
        "installs into the environment: the suite's environment is that install "
        "(tests/test_packaging.py installs the package)",
    ("README.md", "tvm-distx deploy bundle/ --hostfile hosts.txt"):
        "several hosts over ssh (tests/hosts/test_deploy.py, on test hosts)",
    ("README.md", "tvm-distx run bundle/ -n 2 -i x.npy --hostfile hosts.txt"):
        "several hosts over ssh (tests/runtime/, on test hosts)",
    ("docs/across-machines.md", "tvm-distx deploy model/"):
        "several hosts over ssh (tests/hosts/test_deploy.py, on test hosts)",
    ("docs/across-machines.md", "tvm-distx run model/ -n 4"):
        "several hosts over ssh (tests/runtime/, on test hosts)",
    ("docs/across-machines.md", "HOSTFILE=hosts.txt model/run.sh"):
        "several hosts over ssh (tests/runtime/, on test hosts)",
    ("docs/across-machines.md", "tvm-distx generate chat/ --ids 1 15 22 --hostfile"):
        "several hosts over ssh (tests/llm/test_causal_lm_across_hosts.py)",
    ("docs/across-machines.md", "tvm-distx generate ckpt/ --prompt \"Hello\" -n 4 --stages 2"):
        "several hosts over ssh (tests/llm/test_causal_lm_across_hosts.py, 2 stages on 2 "
        "test hosts; tests/cli/test_user_journey.py, --stages on this host)",
    ("docs/across-machines.md", "tvm-distx generate ckpt/ --prompt \"Hello\" -n 2 --stages 10,14"):
        "several hosts over ssh, and a model of 24 layers (tests/llm/test_causal_lm_stages.py "
        "gives the layers of each stage)",
    ("docs/across-machines.md", "scripts/testhosts up 3"):
        "test hosts need root and namespaces (tests/test_testhosts.py)",
    ("docs/across-machines.md", 'eval "$(scripts/testhosts env)"'):
        "test hosts (tests/test_testhosts.py)",
    ("docs/across-machines.md", "export TVM_DISTX_RSH=$TESTHOSTS_RSH"):
        "test hosts (tests/test_testhosts.py)",
    ("docs/across-machines.md", "printf 't2\\nt1\\n' > hosts.txt"):
        "test hosts (tests/test_testhosts.py)",
    ("docs/across-machines.md", "tvm-distx run model/ -n 2 -i x.npy --hostfile"):
        "several hosts over ssh (tests/runtime/, on test hosts)",
    ("docs/across-machines.md", "scripts/testhosts link t1 down"):
        "test hosts (tests/test_testhosts.py)",
    ("docs/across-machines.md", "scripts/testhosts down"):
        "test hosts (tests/test_testhosts.py)",
    ("docs/autoshard.md", "tvm-distx autoshard model.py --mesh 2 --function prefill"):
        "needs a decoder with a prefill function (tests/autoshard/test_autoshard_cli.py runs "
        "--function and --size)",
    ("docs/cli.md", "tvm-distx generate"):
        "needs a generation bundle or a checkpoint (tests/llm/test_text.py, "
        "tests/llm/test_causal_lm.py run generate)",
    ("docs/cli.md", "tvm-distx deploy bundle/"):
        "several hosts over ssh (tests/hosts/test_deploy.py, tests/cli/test_deploy_command.py)",
    ("docs/generation.md", "tvm-distx generate"):
        "needs a generation bundle or a checkpoint (tests/llm/test_text.py, "
        "tests/llm/test_causal_lm.py run generate)",
    ("docs/index.md", ".venv/bin/python -m sphinx"):
        "the site build, which tests/test_docs.py runs with -W",
    ("docs/performance.md", "scripts/bench/all"): "benchmarks (tests/test_benchmarks.py)",
    ("docs/performance.md", "python scripts/bench/"): "benchmarks across test hosts",
    ("docs/serving.md", "pip install -e"):
        "installs into the environment (tests/test_packaging.py)",
    ("docs/serving.md", "tvm-distx serve"):
        "a live server (tests/serving/test_openai_server.py)",
    ("docs/serving.md", "curl"):
        "needs a live server (tests/serving/test_serving_docs.py runs each curl against one)",
    ("docs/targets.md", "python - <<'EOF'"):
        "a local Llama checkpoint, for RISC-V boards (tests/board/, tests/llm/)",
    ("docs/targets.md", "tvm-distx deploy llama-rvv"): "RISC-V boards over ssh (tests/board/)",
    ("docs/targets.md", "scp hosts.txt board1"): "RISC-V boards over ssh (tests/board/)",
    ("docs/targets.md", "ssh board1"): "RISC-V boards over ssh (tests/board/)",
    ("docs/testhosts.md", "scripts/"): "test hosts and board builds, as root (tests/test_testhosts.py)",
    ("docs/testhosts.md", 'eval "$(scripts/testhosts'): "test hosts (tests/test_testhosts.py)",
    ("docs/testhosts.md", "$TESTHOSTS_RSH"): "test hosts (tests/test_testhosts.py)",
    ("docs/testhosts.md", "mpiexec -launcher ssh"): "test hosts (tests/test_testhosts.py)",
    ("tutorials/README.md", "../.venv/bin/pip install notebook"):
        "installs Jupyter's server, which no extra holds",
    ("tutorials/README.md", "../.venv/bin/jupyter notebook"): "a live server, for a browser",
}


def _commands(block: str) -> list[str]:
    """The block's commands: lines joined while a quote, a ``\\`` or a here-document is open."""
    commands: list[str] = []
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        command = lines[i]
        i += 1
        if not command.strip() or command.lstrip().startswith("#"):
            continue
        heredoc = re.search(r"<<-?\s*'?(\w+)'?", command)
        if heredoc:  # up to the line that ends it
            while i < len(lines):
                command += "\n" + lines[i]
                i += 1
                if lines[i - 1].strip() == heredoc.group(1):
                    break
        else:
            while command.endswith("\\") or not _closed(command):
                command += "\n" + lines[i]
                i += 1
        commands.append(command)
    return commands


def _closed(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return True


def _page_commands() -> dict[str, list[str]]:
    found = {}
    for page in PAGES:
        blocks = re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M)
        found[page.relative_to(ROOT).as_posix()] = [c for b in blocks for c in _commands(b)]
    return found


def _reason(page: str, command: str) -> str | None:
    reasons = [r for (p, start), r in NOT_HERE.items() if p == page and command.startswith(start)]
    assert len(reasons) <= 1, (page, command)
    return reasons[0] if reasons else None


def test_commands_are_cut_as_a_shell_reads_them():
    readme = _page_commands()["README.md"]
    tour = next(c for c in readme if c.startswith("python -c"))
    assert tour.count("\n") == 2 and tour.endswith('A=A, B=B)"')  # a quoted string, 3 lines
    echo = next(c for c in readme if c.startswith("echo '["))
    assert echo.endswith("> rules.json")
    heredoc = next(c for c in _page_commands()["docs/targets.md"] if c.startswith("python -"))
    assert heredoc.endswith("\nEOF") and "lm.close()" in heredoc
    curl = [c for c in _page_commands()["docs/serving.md"] if c.startswith("curl")]
    assert len(curl) == 5 and all(c.startswith("curl") for c in curl)


def test_every_exclusion_names_documented_commands_and_says_why():
    commands = _page_commands()
    for (page, start), reason in NOT_HERE.items():
        assert any(c.startswith(start) for c in commands[page]), (page, start)
        assert len(reason) > 10, (page, start)


def _run_here() -> dict[str, list[str]]:
    return {page: [c for c in commands if _reason(page, c) is None]
            for page, commands in _page_commands().items()}


def test_the_first_steps_are_among_the_commands_run():
    run = _run_here()
    assert run["README.md"][0] == "scripts/demo   # the main job: annotate two small programs, " \
        "explain them, run one on 2 ranks"
    assert any(c.startswith("tvm-distx run bundle/ -n 2 -i x.npy -o out/") for c in run["README.md"])
    assert run["tutorials/README.md"][0] == "scripts/demo --full"
    assert any(c.startswith("tvm-distx bundle") for c in run["docs/cli.md"])


def _python_block(page: Path) -> str:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)[0]


def _environment(clone: Path) -> dict[str, str]:
    """``clone/.venv``: this suite's packages, and the clone's own tvm_distx first."""
    env_dir = clone / ".venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    purelib = next(env_dir.glob("lib/python*/site-packages"))
    paths = [str(clone)] + [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (purelib / "suite-packages.pth").write_text("\n".join(paths) + "\n")
    python = env_dir / "bin" / "python"
    for name, module in (("tvm-distx", "tvm_distx.cli.main import console as main"),
                         ("jupyter", "jupyter_core.command import main"),
                         ("jupyter-execute", "nbclient.cli import main")):
        script = env_dir / "bin" / name
        script.write_text(f"#!{python}\nimport sys\nfrom {module}\nsys.exit(main())\n")
        script.chmod(0o755)
    here = Path(sys.executable).parent
    for name in ("mpiexec", "mpiexec.hydra", "hydra_pmi_proxy"):
        if (here / name).exists():
            (env_dir / "bin" / name).symlink_to((here / name).resolve())
    # the mpich wheel's libraries where mpi4py looks for them, the environment's lib/, with
    # the folder their $ORIGIN run path names (mpich/libfabric)
    for entry in (Path(sys.prefix) / "lib").iterdir():
        if not entry.name.startswith("python") and not (env_dir / "lib" / entry.name).exists():
            (env_dir / "lib" / entry.name).symlink_to(entry.resolve())
    # what scripts/_env.sh writes after installing the test extra: the set-up is done
    stamp = hashlib.sha256((clone / "pyproject.toml").read_bytes() + b"extras=test\n")
    (env_dir / ".tvm_distx-installed").write_text(stamp.hexdigest() + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if Path(p) != here)
    env.pop("COLUMNS", None)
    return env


def _git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=clone, capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A fresh clone of this checkout, with the working tree's changes to tracked files."""
    clone = tmp_path_factory.mktemp("fresh") / "tvm-distx"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=ROOT, capture_output=True,
                          check=True).stdout
    if diff:
        subprocess.run(["git", "apply", "--whitespace=nowarn"], cwd=clone, input=diff,
                       check=True)
    return clone, _environment(clone)


def _bash(script: str, cwd: Path, env: dict[str, str], timeout: float = 600):
    done = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, (script[-2000:], done.stdout[-3000:], done.stderr[-3000:])
    return done


def _script(commands: list[str], activate: str | None = ".venv/bin/activate") -> str:
    """The commands as one shell session; ``source ACTIVATE`` first, as the README says."""
    start = f"source {activate}\n" if activate else ""
    return "set -euo pipefail\n" + start + "\n".join(commands) + "\n"


def test_the_documented_steps_run_as_written_in_a_fresh_clone(clone, tmp_path):
    clone, env = clone
    before = _git(clone, "status", "--porcelain")
    run = _run_here()
    # the README, from the clone's root: the two commands, the Python tour, the command line
    tour = tmp_path / "tour.py"
    tour.write_text(_python_block(clone / "README.md"))
    readme = run["README.md"]
    done = _bash(_script([readme[0], f"python {shlex.quote(str(tour))}", *readme[1:]]),
                 clone, env)
    assert "# ---- what next\n" in done.stdout  # the demo ran to its end
    assert float(done.stdout.split("mpi max |error|:")[1].split()[0]) < 1e-5
    home = clone / "tour"
    rng = np.random.default_rng(0)
    x, a, b = (0.1 * rng.standard_normal((128, 128), dtype="float32") for _ in range(3))
    mlp = lambda v: np.maximum(v @ a, 0) @ b  # noqa: E731
    np.testing.assert_allclose(np.load(home / "out" / "out0.npy"), mlp(mlp(x)), atol=1e-5)
    assert "all_reduce" in done.stdout and "65,536" in done.stdout  # plan's report
    # the guides, in tour/, where the README's command-line block left its files
    ran = []
    for page, commands in run.items():
        if page.startswith("docs/") and commands:
            _bash(_script(commands, "../.venv/bin/activate"), home, env)
            ran.append(page)
    assert ran == ["docs/autoshard.md", "docs/cli.md", "docs/execution.md"]
    assert (home / "annotated.py").is_file() and (home / "A.png").is_file()
    assert (home / "rvv" / "manifest.json").is_file() and (home / "auto" / "manifest.json").is_file()
    # the tutorials' set-up and one notebook, from the root
    done = _bash(_script(run["tutorials/README.md"], activate=None), clone, env)
    assert "what next" in done.stdout  # scripts/demo --full ran the demo, installing nothing
    assert "[setup]" not in done.stdout + done.stderr
    # everything written is in tour/ (ignored by git) or gone
    assert _git(clone, "status", "--porcelain") == before
    ignored = {line[3:] for line in _git(clone, "status", "--porcelain", "--ignored").splitlines()
               if line.startswith("!! ")}
    assert {i for i in ignored if "__pycache__" not in i} == {".venv/", "tour/"}
    shutil.rmtree(clone / ".venv")
