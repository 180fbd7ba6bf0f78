"""The documentation: the site builds with warnings as errors, and the README stays a README.

The site (``docs/``: the user guide in Markdown, the API reference from the numpydoc
docstrings, the command-line reference from the parser) is built by Sphinx into a temporary
directory, with ``-W`` so that a broken docstring, a dangling link or a page left out of the
table of contents fails here. The Python blocks of the pages are run by ``test_readme.py``.
"""

from __future__ import annotations

import argparse
import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tvm_distx.cli.main import _parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: The README and every page of the guide (``architecture.md`` is the design's own page).
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
#: Names renamed in issue 29, which the pages must not show as current.
DEPRECATED = ["with_meshes(", "data_and_model", "moe_parallel", "tensor_parallel_experts",
              "td.distribute(", "tvm_distx.distribute", "td.profile(", "tvm_distx.profile",
              "MeshRef", "module_meshes", "td.CostProfile", "tvm_distx.CostProfile",
              "from tvm_distx import ShardingError", "tvm_distx.ShardingError",
              "tvm_distx.BundleError", "tvm_distx.LaunchError", "td.SymbolicExtentError"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-j", "1",
                           "-q", "-b", "html", str(DOCS), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    return out


def test_the_site_builds_with_warnings_as_errors(site):
    for page in ("index", "concepts", "cli", "pytorch", "generation", "autoshard", "moe",
                 "targets", "performance", "reliability", "status", "architecture",
                 "api/toplevel", "api/errors"):
        assert (site / f"{page}.html").is_file(), page
    toplevel = (site / "api" / "toplevel.html").read_text()
    for name in ("tvm_distx.compile", "tvm_distx.DistExecutable", "tvm_distx.CausalLM",
                 "tvm_distx.AnnotateSharding", "tvm_distx.set_device_meshes"):
        assert f'id="{name}"' in toplevel, name  # documented from its docstring


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_cli_reference_lists_every_subcommand_and_flag(site):
    raw = (site / "cli.html").read_text()
    page = html.unescape(re.sub(r"<[^>]+>", " ", raw))
    parser = _parser()
    for flag in (s for a in parser._actions if not isinstance(a, argparse._HelpAction)
                 for s in a.option_strings):
        assert flag in page, flag
    for name, sub in _subcommands(parser).items():
        assert f'id="tvm-distx-{name}"' in raw, name  # the subcommand's own section
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # -h/--help: every subcommand has it, the reference leaves it out
            for flag in action.option_strings:
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", page), (name, flag)
            if action.help and action.help != argparse.SUPPRESS:
                assert " ".join(action.help.split()[:4]) in " ".join(page.split()), (name, action.dest)


def test_the_readme_is_short_and_links_into_the_guide():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for extra in ("[torch]", "[hf]", "[auto]", "[test]"):  # which extra each feature needs
        assert f'pip install -e ".{extra}"' in text, extra
    assert "scripts/demo" in text and "scripts/test" in text
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).is_file(), link


def test_pages_run_every_python_block_and_name_no_deprecated_api():
    for page in PAGES:
        text = page.read_text()
        # a Python block is ```python (run by test_readme.py); anything else is text or shell
        assert not re.search(r"^```(py|python3|pycon)\s*$", text, flags=re.M), page
        if page.name == "architecture.md" or page.parent.name == "api":
            continue  # the design's page; the API pages exclude the deprecated names by name
        for name in DEPRECATED:
            assert name not in text, (page.name, name)
