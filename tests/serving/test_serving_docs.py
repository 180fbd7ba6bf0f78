"""The serving guide's examples (``docs/serving.md``) run against a live server.

Its ``curl`` commands and its ``openai`` client block address ``http://127.0.0.1:8000``
with the key ``secret`` and the model ``my_bundle``; here they address a server of that
name and key on a free port (``tests/test_readme.py`` leaves this page's blocks to this
test, which has the server they need).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from locations import REPO_ROOT

pytest.importorskip("openai")

PAGE = REPO_ROOT / "docs" / "serving.md"
DOCUMENTED = "http://127.0.0.1:8000"


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


def _curl_commands() -> list[str]:
    commands = []
    for block in _blocks("bash"):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("curl "):
                commands.append(command)
    return commands


@pytest.fixture(scope="module")
def docs_server(exported, start_server, tmp_path_factory):
    *_, bundle = exported
    named = tmp_path_factory.mktemp("docs") / "my_bundle"
    named.symlink_to(bundle, target_is_directory=True)
    with start_server(named, "--api-key", "secret") as (_, url):
        yield url.removesuffix("/v1")


def test_the_guide_has_curl_and_client_examples():
    assert len(_curl_commands()) == 5 and len(_blocks("python")) == 1


@pytest.mark.parametrize("index", range(5))
def test_each_curl_command_of_the_guide_answers(docs_server, index):
    command = _curl_commands()[index].replace(DOCUMENTED, docs_server)
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if '"stream": true' in command:
        events = [line[6:] for line in done.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 3
        assert all("choices" in json.loads(e) for e in events[:-1])
    else:
        answer = json.loads(done.stdout)
        assert "error" not in answer, answer
        assert answer.get("object") in {"list", "text_completion", "chat.completion"} or \
            answer.get("status") == "ok", answer


def test_the_client_example_of_the_guide_runs(docs_server, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(_blocks("python")[0].replace(DOCUMENTED, docs_server))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "streamed equals the reply: True" in done.stdout
    assert re.search(r"reply: .* \d+", done.stdout)
