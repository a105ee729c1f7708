"""Batch requests for ``mini-deepinfer generate`` (alias ``run-batch``), served by the server's own
request handling: each request goes through the real app (in this process, over ASGI, without a
socket) to a real engine, so every field is honoured, or refused with the 400 naming it, exactly
as over HTTP.

Two input formats, one per file (blank lines are skipped; line numbers count them):

* OpenAI's batch format: ``{"custom_id", "method": "POST", "url": "/v1/completions" or
  "/v1/chat/completions", "body": {...}}``; each result line is ``{"id", "custom_id", "response":
  {"status_code", "request_id", "body"}, "error"}``, in input order, where ``body`` is what the
  server answers (the completion, or the error envelope; ``error`` then holds its code and message).
  A request the server refuses fails alone.
* The original format: one completion per line, ``prompt`` (text) or ``prompt_token_ids`` plus any
  /v1/completions field; each result line is ``{"index", "token_ids", "text", "finish_reason"}``
  (with ``logprobs``: the chosen tokens' logprobs). A line that cannot be served stops the run with
  an error naming it, and nothing is written.

A line that is not a request at all (not JSON, a missing ``custom_id``, another URL) is an error
naming it before the engine starts.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import ValidationError

from .errors import APIError, validation_error
from .openai_types import CompletionRequest
from .request_fields import COMPLETION_FIELDS, check_fields

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
OVERLOADED_RETRY_S = 0.05  # a full engine frees sequences quickly


@dataclass
class BatchRequest:
    line: int  # in the input file, from 1
    custom_id: str | None  # None: a line in the original format
    url: str
    body: dict[str, Any]


@dataclass
class BatchResult:
    request: BatchRequest
    status: int
    body: dict[str, Any]
    request_id: str


# ----------------------------------------------------------------------------- reading
def read_requests(lines: list[str]) -> list[BatchRequest]:
    """The requests of a file's lines; ValueError ``line N: ...`` for a line that is not one."""
    requests: list[BatchRequest] = []
    seen: set[str] = set()
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        request = parse_line(text, number)
        if requests and (request.custom_id is None) != (requests[0].custom_id is None):
            raise ValueError(f"line {number}: every line of a file must have the same format (line "
                             f"{requests[0].line} is {'an OpenAI batch request' if requests[0].custom_id else 'a prompt'})")
        if request.custom_id is not None:
            if request.custom_id in seen:
                raise ValueError(f"line {number}: custom_id {request.custom_id!r} is used twice")
            seen.add(request.custom_id)
        requests.append(request)
    return requests


def parse_line(text: str, number: int) -> BatchRequest:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"line {number}: expected a JSON object")
    if "custom_id" in raw or "body" in raw:
        return _openai_request(raw, number)
    return BatchRequest(number, None, "/v1/completions", _original_body(raw, number))


def _openai_request(raw: dict, number: int) -> BatchRequest:
    custom_id = raw.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"line {number}: custom_id must be a non-empty string")
    if raw.get("method", "POST") != "POST":
        raise ValueError(f"line {number}: method must be POST, got {raw.get('method')!r}")
    if raw.get("url") not in ENDPOINTS:
        raise ValueError(f"line {number}: url must be one of {', '.join(ENDPOINTS)}, got {raw.get('url')!r}")
    if not isinstance(raw.get("body"), dict):
        raise ValueError(f"line {number}: body must be a JSON object (the request)")
    unknown = sorted(set(raw) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"line {number}: unknown key(s) {', '.join(unknown)} (fields of the request go in body)")
    return BatchRequest(number, custom_id, raw["url"], raw["body"])


def _original_body(raw: dict, number: int) -> dict:
    """A line of the original format as a /v1/completions body, checked as the server checks one
    (so its errors come before the engine starts)."""
    body = dict(raw)
    if "prompt_token_ids" in body:
        if "prompt" in body:
            raise ValueError(f"line {number}: give one of prompt, prompt_token_ids")
        ids = body.pop("prompt_token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"line {number}: prompt_token_ids must be a list of integers")
        body["prompt"] = ids
    elif not isinstance(body.get("prompt"), str):
        raise ValueError(f"line {number}: needs 'prompt' (text) or 'prompt_token_ids'")
    for name, why in (("n", "several choices"), ("stream", "streaming")):
        if body.get(name) not in (None, 1, False):
            raise ValueError(f"line {number}: {name}: {why} need the OpenAI batch format (custom_id, url, body)")
    body["return_token_ids"] = True
    try:
        check_fields(CompletionRequest.model_validate(body), COMPLETION_FIELDS)
    except ValidationError as exc:
        raise ValueError(f"line {number}: {validation_error(exc.errors()).message}") from None
    except APIError as exc:
        raise ValueError(f"line {number}: {exc.message}") from None
    return body


# ----------------------------------------------------------------------------- running
async def run_requests(app, requests: list[BatchRequest], concurrency: int,
                       on_done: Callable[[], None] = lambda: None) -> list[BatchResult]:
    """Every request through ``app`` (at most ``concurrency`` at once; one the server finds full is
    retried), results in input order."""
    import httpx

    slots = asyncio.Semaphore(max(1, concurrency))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        async def one(request: BatchRequest) -> BatchResult:
            async with slots:
                result = await _send(client, request)
            on_done()
            return result

        return list(await asyncio.gather(*(one(r) for r in requests)))


async def _send(client, request: BatchRequest) -> BatchResult:
    if request.body.get("stream"):
        error = {"message": "stream is not supported in a batch", "type": "invalid_request_error",
                 "param": "stream", "code": None}
        return BatchResult(request, 400, {"error": error}, "")
    while True:
        response = await client.post(request.url, json=request.body)
        body = response.json()
        overloaded = response.status_code == 503 and (body.get("error") or {}).get("code") == "server_overloaded"
        if not overloaded:
            return BatchResult(request, response.status_code, body, response.headers.get("x-request-id", ""))
        await asyncio.sleep(OVERLOADED_RETRY_S)


# ----------------------------------------------------------------------------- writing
def openai_output(result: BatchResult) -> dict:
    error = None
    if result.status != 200:
        details = result.body.get("error") or {}
        error = {"code": details.get("code") or details.get("type"), "message": details.get("message")}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": result.request.custom_id,
            "response": {"status_code": result.status, "request_id": result.request_id, "body": result.body},
            "error": error}


def original_output(index: int, result: BatchResult) -> dict:
    """The original result line; ValueError naming the input line if the server refused it."""
    if result.status != 200:
        message = (result.body.get("error") or {}).get("message") or f"status {result.status}"
        raise ValueError(f"line {result.request.line}: {message}")
    choice = result.body["choices"][0]
    record = {"index": index, "token_ids": choice["token_ids"], "text": choice["text"],
              "finish_reason": choice["finish_reason"]}
    if choice.get("logprobs") is not None:
        record["logprobs"] = choice["logprobs"]["token_logprobs"]
    return record
