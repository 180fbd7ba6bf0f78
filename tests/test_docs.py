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
import tomllib
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


#: The extra each guide needs, named in its opening paragraph (the text before its first
#: ``##``): ``None`` for a guide that needs none, which it says ("needs no extra").
GUIDE_EXTRAS = {
    "concepts.md": None,
    "execution.md": None,
    "across-machines.md": None,
    "cli.md": {"auto", "hf", "serve"},
    "pytorch.md": {"torch", "hf"},
    "generation.md": {"hf"},
    "weights.md": {"hf"},
    "autoshard.md": {"auto", "torch"},
    "moe.md": {"hf"},
    "serving.md": {"serve"},
    "targets.md": {"hf"},
}
#: Pages that document no feature a user installs, each with the reason.
NOT_GUIDES = {
    "index.md": "the site's front page: points to the README's set-up and extras table",
    "architecture.md": "for people who change tvm-distx (the test extra has everything)",
    "benchmarks.md": "the benchmarks' tables, included from scripts/bench",
    "performance.md": "the benchmarks, run by scripts/bench/all in the test environment",
    "reliability.md": "what scripts/test checks",
    "status.md": "what is done, with links to the guides",
    "testhosts.md": "the suite's test hosts: root and system python3, no virtual environment",
    "tvm-wheel.md": "the pinned TVM wheel, a dependency of the package itself",
}


def _extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _opening(page: Path) -> str:
    text = page.read_text()
    return text[:text.index("\n## ")] if "\n## " in text else text


def test_every_guide_names_the_extra_it_needs_in_its_opening():
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages == set(GUIDE_EXTRAS) | set(NOT_GUIDES), pages ^ (set(GUIDE_EXTRAS) | set(NOT_GUIDES))
    assert not set(GUIDE_EXTRAS) & set(NOT_GUIDES)
    extras = _extras()
    for name, needed in GUIDE_EXTRAS.items():
        opening = " ".join(_opening(DOCS / name).split())
        if needed is None:
            assert "no extra" in opening, name
            continue
        for extra in needed:
            assert extra in extras, (name, extra)  # a renamed extra fails here
            assert re.search(rf"`{extra}`(?: and `\w+`)? extras?\b", opening), (name, extra)


def test_the_extras_a_guide_names_hold_what_its_examples_import():
    extras = _extras()
    provides = {extra: {re.split(r"[=<>\[ ]", req)[0] for req in reqs}
                for extra, reqs in extras.items()}
    for name, needed in GUIDE_EXTRAS.items():
        blocks = "\n".join(re.findall(r"```(?:python|bash)\n(.*?)```", (DOCS / name).read_text(),
                                      flags=re.S))
        imported = {m.split(".")[0] for m in
                    re.findall(r"^\s*(?:import|from)\s+([\w.]+)", blocks, flags=re.M)}
        for package in imported & {"torch", "transformers", "scipy", "fastapi", "gguf"}:
            assert any(package in provides[e] for e in needed or ()), (name, package)


def test_the_readme_says_what_each_command_installs_and_how_to_get_the_rest():
    text = (ROOT / "README.md").read_text()
    section = " ".join(text[text.index("## Two commands"):text.index("\n## ", text.index(
        "## Two commands") + 1)].split())
    assert "`scripts/demo`: the package with no extra" in section
    assert "`scripts/demo --full`, and `scripts/test`: the `test` extra" in section
    assert "No module named 'torch'" in section and "everything installed" not in section
    demo = (ROOT / "scripts" / "demo").read_text()
    assert 'if [ "$arg" = --full ]; then EXTRAS=test' in demo
    assert "test" in _extras()
    # the test extra holds every other extra's packages, so --full runs every guide
    everything = set(_extras()["test"])
    for extra, reqs in _extras().items():
        assert set(reqs) <= everything, (extra, set(reqs) - everything)
