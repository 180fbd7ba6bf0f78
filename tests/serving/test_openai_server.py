"""``tvm-distx serve`` on 2 MPI ranks, talked to by the real ``openai`` client.

A bundle of a tiny Llama with a tokenizer trained in the test (``tiny_text``) is served
by the command line in its own process. Greedy text through the server equals
``lm.generate`` text equals transformers' decoded greedy output; streamed text equals the
text; a client that disconnects mid-stream leaves the server serving; four concurrent
requests all get their text; a bad request is a 400 and a wrong API key a 401, each as
OpenAI's JSON error.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import signal
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import proc_tools

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

KEY = "test-key"
NEW = 12
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def served(exported, start_server):
    """(transformers model and tokenizer, the CausalLM, the server's base URL)."""
    model, hf, lm, bundle = exported
    with start_server(bundle, "--api-key", KEY) as (_, url):
        yield model, hf, lm, url


def _get(url: str) -> tuple[int, dict]:
    """The status and JSON body of a GET (standard library only)."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _post_raw(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _client(url: str, key: str = KEY):
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


def _transformers_text(model, hf, ids) -> str:
    with torch.no_grad():
        out = model.generate(torch.tensor([list(ids)]), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=hf.pad_token_id)
    return hf.decode(out[0, len(ids):], skip_special_tokens=True)


def test_the_model_is_listed_and_health_reports_the_ranks(served):
    *_, url = served
    assert [m.id for m in _client(url).models.list().data] == ["tiny-llama"]
    status, health = _get(url.removesuffix("/v1") + "/health")
    assert status == 200 and health["status"] == "ok"
    assert health["ranks"] == 2 and health["backend"] == "mpi"


def test_greedy_completion_equals_lm_generate_and_transformers(served):
    model, hf, lm, url = served
    want = _transformers_text(model, hf, hf("hello world").input_ids)
    assert lm.generate("hello world", max_new_tokens=NEW) == want
    done = _client(url).completions.create(model="tiny-llama", prompt="hello world",
                                           max_tokens=NEW, temperature=0)
    assert done.choices[0].text == want
    assert done.usage.prompt_tokens == len(hf("hello world").input_ids)
    assert done.usage.completion_tokens == lm.text_stats.completion_tokens


def test_greedy_chat_equals_lm_chat_and_transformers(served):
    model, hf, lm, url = served
    ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    want = _transformers_text(model, hf, ids)
    assert lm.chat(MESSAGES, max_new_tokens=NEW) == want
    done = _client(url).chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                                max_tokens=NEW, temperature=0)
    assert done.choices[0].message.content == want
    assert done.choices[0].message.role == "assistant"


def test_streamed_text_equals_the_text_and_ends_with_usage(served):
    *_, url = served
    client = _client(url)
    whole = client.chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                           max_tokens=NEW, temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=NEW, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}
    pieces = client.completions.create(model="tiny-llama", prompt="hello world",
                                       max_tokens=NEW, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == client.completions.create(
        model="tiny-llama", prompt="hello world", max_tokens=NEW, temperature=0
    ).choices[0].text


def test_a_client_that_disconnects_mid_stream_leaves_the_server_serving(served):
    model, hf, lm, url = served
    body = {"model": "tiny-llama", "prompt": "the lazy dog", "max_tokens": 80,
            "temperature": 0, "stream": True}
    where = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
    connection.request("POST", f"{where.path}/completions", body=json.dumps(body),
                       headers={"Authorization": f"Bearer {KEY}",
                                "Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    events = [response.readline() for _ in range(4)]
    assert events[0].startswith(b"data: ")
    connection.close()  # the client goes away with most of the text unread
    done = _client(url).completions.create(model="tiny-llama", prompt="hello world",
                                           max_tokens=NEW, temperature=0)
    assert done.choices[0].text == lm.generate("hello world", max_new_tokens=NEW)
    assert _get(url.removesuffix("/v1") + "/health")[1]["status"] == "ok"


def test_four_concurrent_requests_each_get_their_text(served):
    _, _, lm, url = served
    prompts = ["hello world", "the cat sat", "a sharded model", "tokens stream"]
    client = _client(url)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: client.completions.create(
            model="tiny-llama", prompt=p, max_tokens=NEW, temperature=0).choices[0].text,
            prompts))
    assert answers == [lm.generate(p, max_new_tokens=NEW) for p in prompts]


def test_seeded_sampling_repeats(served):
    *_, url = served
    client = _client(url)
    ask = lambda seed: client.completions.create(  # noqa: E731
        model="tiny-llama", prompt="hello", max_tokens=NEW, temperature=0.9, top_p=0.95,
        seed=seed).choices[0].text
    assert ask(5) == ask(5)


@pytest.mark.parametrize("request_body, param", [
    ({"prompt": "hi", "temperature": 5}, "temperature"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_a_bad_request_is_a_400_as_openai_answers_it(served, request_body, param):
    *_, url = served
    with pytest.raises(openai.BadRequestError) as err:
        _client(url).completions.create(model="tiny-llama", **request_body)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        _client(url).chat.completions.create(model="tiny-llama", messages=[])


def test_a_wrong_api_key_is_a_401_and_another_model_a_404(served):
    *_, url = served
    with pytest.raises(openai.AuthenticationError) as err:
        _client(url, key="wrong").models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        _client(url).completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    status, answer = _post_raw(f"{url}/completions", b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]


def _is_rank(pid: int) -> bool:
    """Whether process ``pid`` is a rank (Python running our rank module, not mpiexec)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return Path(argv[0].decode()).name.startswith("python") and any(
        b"tvm_distx.runtime" in arg for arg in argv)


def test_a_rank_failure_is_a_500_naming_the_rank_and_the_server_says_it_cannot_go_on(
        exported, start_server):
    *_, bundle = exported
    with start_server(bundle, "--api-key", KEY) as (server, url):
        client = _client(url)
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2, temperature=0)
        family = proc_tools.parents()
        below = {server.pid}
        for _ in range(6):  # the server, mpiexec, its proxy, the ranks
            below |= {pid for pid, parent in family.items() if parent in below}
        ranks = sorted(pid for pid in below if _is_rank(pid))
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="tiny-llama", prompt="hi", max_tokens=4,
                                      temperature=0)
        message = err.value.body["message"]
        assert re.search(r"rank \d failed", message) and "cannot go on" in message, message
        status, health = _get(url.removesuffix("/v1") + "/health")
        assert status == 503 and health["status"] == "failed" and "rank" in health["error"]
        with pytest.raises(openai.InternalServerError):  # every later request is told so
            client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2)
