"""The OpenAI-compatible HTTP API over a :class:`~tvm_distx.generation.worker.GenerationWorker`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (with
``"stream": true`` as server-sent events, ending in ``data: [DONE]``) and ``GET /health``.
The requests and responses follow OpenAI's API, so its clients (the ``openai`` package,
``curl``) talk to it as they are:

* sampling as OpenAI's API defines it: ``temperature`` (1 by default; 0 is greedy),
  ``top_p``, ``seed``, ``stop`` (up to 4 strings), ``max_tokens`` (``max_completion_tokens``
  for chat); and, as vLLM accepts them, ``top_k``, ``min_p`` and ``repetition_penalty``;
* ``usage`` counts the prompt and completion tokens (in the last streamed chunk when
  ``stream_options.include_usage`` is set);
* errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
  request, 401 for a wrong API key (``Authorization: Bearer``), 404 for another model's
  name, 503 when the queue is full, and 500 naming the rank when the ranks fail, after
  which the server says it cannot go on (``/health`` too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from tvm_distx.errors import (ApiRequestError, ArgumentError, DistxError, LaunchError,
                              ServerBusyError)
from tvm_distx.generation.worker import GenerationWorker, Job, Result

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


def _response(err: ApiRequestError) -> JSONResponse:
    return JSONResponse(status_code=err.status, content={"error": err.body()})


def create_app(worker: GenerationWorker, *, model_name: str, ranks: int, backend: str,
               api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``worker``'s model as ``model_name``.

    Parameters
    ----------
    worker : GenerationWorker
        Runs the generations; its model needs a tokenizer.
    model_name : str
        The id ``/v1/models`` lists and requests name.
    ranks : int
        The rank count, reported by ``/health``.
    backend : str
        Where the ranks run, reported by ``/health``.
    api_key : str, optional
        When given, every ``/v1`` request must carry ``Authorization: Bearer <api_key>``.
    """
    app = FastAPI(title="tvm-distx", docs_url=None, redoc_url=None)
    lm = worker.lm
    created = int(time.time())

    @app.exception_handler(ApiRequestError)
    async def _api_error(request: Request, err: ApiRequestError):  # noqa: ARG001
        return _response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):  # noqa: ARG001
        return _response(ApiRequestError(
            400, f"invalid request: {err.errors()[0].get('msg', err)}"))

    @app.middleware("http")
    async def _authorize(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if given != f"Bearer {api_key}":
                return _response(ApiRequestError(401, "Incorrect API key provided",
                                                 code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        failure = worker.failure
        body = {"status": "failed" if failure else "ok", "model": model_name, "ranks": ranks,
                "backend": backend, "waiting": worker.waiting}
        if failure is not None:
            body["error"] = _failure_message(failure)
        return JSONResponse(status_code=503 if failure else 200, content=body)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "tvm-distx"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        _check_model(body, model_name)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiRequestError(400, "'prompt' must be a non-empty string", param="prompt")
        ids = _encode(lambda: lm.tokenizer.encode(prompt))
        job = _job(body, prompt, len(ids), lm, default_max=16, max_field="max_tokens")
        return await _answer(worker, job, body, model_name, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request)
        _check_model(body, model_name)
        messages = _messages(body.get("messages"))
        ids = _encode(lambda: lm.tokenizer.encode_chat(messages))
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        job = _job(body, messages, len(ids), lm, default_max=None, max_field=field)
        return await _answer(worker, job, body, model_name, chat=True)

    return app


# ---------------------------------------------------------------------- requests
async def _body(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiRequestError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiRequestError(400, "the request body must be a JSON object")
    return body


def _check_model(body: dict, name: str) -> None:
    model = body.get("model")
    if model is not None and model != name:
        raise ApiRequestError(404, f"The model '{model}' does not exist; this server serves "
                       f"'{name}'", param="model", code="model_not_found")


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiRequestError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiRequestError(400, f"messages[{index}] needs a 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is served
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ApiRequestError(400, f"messages[{index}]: only text content is "
                                      "supported", param="messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise ApiRequestError(400, f"messages[{index}] needs a text 'content'",
                                  param="messages")
        out.append({"role": message["role"], "content": content})
    return out


def _encode(encode) -> list[int]:
    try:
        return encode()
    except ArgumentError as err:  # no chat template, messages the template refuses
        raise ApiRequestError(400, err.message) from None


def _number(body: dict, name: str, default, low: float, high: float, *, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        wanted = "an integer" if integer else "a number"
        raise ApiRequestError(400, f"'{name}' must be {wanted} from {low} to {high}, got "
                              f"{value!r}", param=name)
    return value


def _job(body: dict, prompt, prompt_tokens: int, lm, *, default_max: int | None,
         max_field: str) -> Job:
    """The job of a request, its options checked as OpenAI checks them."""
    limit = lm.cache.max_length
    room = limit - prompt_tokens + 1  # the last new token needs no cache position
    if room < 1:
        raise ApiRequestError(400, f"This model's maximum context length is {limit} tokens; the "
                       f"prompt has {prompt_tokens}", param="messages" if isinstance(
                           prompt, list) else "prompt", code="context_length_exceeded")
    max_tokens = _number(body, max_field, default_max or room, 1, 1 << 30, integer=True)
    if max_tokens > room:
        raise ApiRequestError(400, f"This model's maximum context length is {limit} tokens; the "
                       f"prompt has {prompt_tokens} and {max_field} asks {max_tokens} more "
                       f"(at most {room})", param=max_field, code="context_length_exceeded")
    if _number(body, "n", 1, 1, 1, integer=True) != 1:
        raise ApiRequestError(400, "'n' must be 1", param="n")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    options: dict[str, Any] = {"do_sample": temperature > 0, "top_k": 0}
    if temperature > 0:
        options.update(temperature=temperature,
                       top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
                       top_k=_number(body, "top_k", 0, 0, 1 << 30, integer=True),
                       min_p=_number(body, "min_p", None, 0.0, 1.0))
    options["repetition_penalty"] = _number(body, "repetition_penalty", 1.0, 1e-9, 100.0)
    options["seed"] = _number(body, "seed", None, 0, (1 << 63) - 1, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or any(
            not isinstance(s, str) or not s for s in stop)):
        raise ApiRequestError(400, "'stop' must be a string or a list of up to 4 strings",
                       param="stop")
    return Job(prompt, max_tokens, options, list(stop or ()), emit=None, done=None)


# ---------------------------------------------------------------------- answers
async def _answer(worker: GenerationWorker, job: Job, body: dict, model: str, *, chat: bool):
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()
    job.emit = lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, ("piece", piece))
    job.done = lambda result: loop.call_soon_threadsafe(pieces.put_nowait, ("done", result))
    try:
        worker.submit(job)
    except ServerBusyError as err:
        raise ApiRequestError(503, f"the server is busy ({err}); try again later",
                       code="server_busy", kind="server_error") from None
    except DistxError as err:
        raise _failure(err) from None
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if body.get("stream"):
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_events(job, pieces, ident, model, chat, usage),
                                 media_type="text/event-stream")
    try:
        while True:
            kind, value = await pieces.get()
            if kind == "done":
                break
    finally:
        job.cancelled.set()  # a client that went away stops its generation
    if isinstance(value, BaseException):
        raise _failure(value)
    return _completion(ident, model, chat, value)


async def _events(job: Job, pieces: asyncio.Queue, ident: str, model: str, chat: bool,
                  usage: bool):
    """The server-sent events of a streamed answer."""
    created = int(time.time())

    def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> str:
        if chat:
            content = {"role": "assistant", "content": ""} if role else \
                ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": content, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None,
                      "finish_reason": finish}
        return _event({"id": ident, "object": "chat.completion.chunk" if chat else
                       "text_completion", "created": created, "model": model,
                       "choices": [choice]})

    try:
        if chat:
            yield chunk(None, role=True)
        while True:
            kind, value = await pieces.get()
            if kind == "piece":
                yield chunk(value)
                continue
            break
        if isinstance(value, BaseException):
            yield _event({"error": _failure(value).body()})
        else:
            yield chunk(None, finish=value.finish_reason)
            if usage:
                yield _event({"id": ident, "object": "chat.completion.chunk" if chat else
                              "text_completion", "created": created, "model": model,
                              "choices": [], "usage": _usage(value)})
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # the client went away, or the answer is complete


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _usage(result: Result) -> dict:
    return {"prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _completion(ident: str, model: str, chat: bool, result: Result) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": None, "finish_reason": result.finish_reason}
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None,
                  "finish_reason": result.finish_reason}
    return {"id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": _usage(result)}


def _failure_message(err: BaseException) -> str:
    if isinstance(err, LaunchError):
        where = f"rank {err.rank}" if err.rank is not None else "a rank"
        return (f"{where} failed ({err.reason}): {err.message.splitlines()[0]}; the server "
                "cannot go on: restart it")
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _failure(err: BaseException) -> ApiRequestError:
    """The API error of a job's failure."""
    if isinstance(err, LaunchError):
        return ApiRequestError(500, _failure_message(err), code="rank_failed",
                               kind="server_error")
    if isinstance(err, ArgumentError):
        return ApiRequestError(400, err.message)
    logger.error("a request failed: %s", err, exc_info=err)
    return ApiRequestError(500, f"internal error: {_failure_message(err)}", kind="server_error")

