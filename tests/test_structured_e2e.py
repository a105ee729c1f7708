"""Structured output end to end: ``mini-deepinfer serve`` (frontend, engine core, a CPU worker on the
tiny model) driven by the official ``openai`` client. The tiny model's weights are random, so any
output that parses and validates is the constraint's doing, not the model's.

Every completed output (finish_reason "stop") must parse and validate against its JSON schema
(``jsonschema``), full-match its regex, or be one of its choices, greedy and sampled; streamed text
equals the non-streamed text; ``max_tokens`` reached mid-object ends with "length"; and an
unconstrained greedy request batched with constrained ones gets exactly the tokens it gets alone.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_harness import start_server, stop_server

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

# These tests need the engine side of structured output (grammar compilation, token bitmasks);
# without it the constraints reach an engine that cannot enforce them.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("workers.structured_output") is None,
                                reason="the engine has no structured-output support (workers/structured_output.py)")

MAX_TOKENS = 160
SEEDS = [None, 1, 2, 3]  # None: greedy

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                      "admin": {"type": "boolean"}},
                     "required": ["id", "admin"], "additionalProperties": False},
            "tag": {"enum": ["red", "green", "blue"]},
        },
        "required": ["user", "tag"], "additionalProperties": False},
    "array_of_enums": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "minItems": 1, "maxItems": 4},
    "bounded_numbers": {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                       "count": {"type": "integer", "exclusiveMinimum": 10, "maximum": 99}},
        "required": ["score", "ratio", "count"], "additionalProperties": False},
    "optional_fields": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                       "note": {"type": "string", "maxLength": 6},
                       "ok": {"type": "boolean"}},
        "required": ["code"], "additionalProperties": False},
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"k": {"type": "string", "enum": ["x", "y"]},
                                                   "v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
                  "required": ["k", "v"], "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    process, base = start_server(tiny_checkpoint, max_num_seqs=8)
    yield base
    stop_server(process)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def _sampling(seed):
    return {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}


def _complete(client, prompt="Answer:", max_tokens=MAX_TOKENS, seed=None, **extra):
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens,
                                     extra_body=extra, **_sampling(seed)).choices[0]


def _parallel(fn, items):
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, items))


def test_json_schemas_validate_greedy_and_sampled(client):
    jobs = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    results = _parallel(lambda job: _complete(client, seed=job[1], guided_json=SCHEMAS[job[0]]), jobs)
    completed = {name: 0 for name in SCHEMAS}
    for (name, seed), choice in zip(jobs, results):
        assert choice.finish_reason in ("stop", "length"), (name, seed, choice)
        if choice.finish_reason == "length":
            continue
        value = json.loads(choice.text)
        jsonschema.validate(value, SCHEMAS[name])
        completed[name] += 1
    assert all(completed.values()), f"a schema never completed within {MAX_TOKENS} tokens: {completed}"


def test_chat_response_format_json_schema_and_json_object(client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Give me the user as JSON."}]
    schema = SCHEMAS["nested_object"]
    formats = {"json_schema": {"type": "json_schema",
                               "json_schema": {"name": "user", "schema": schema, "strict": True}},
               "json_object": {"type": "json_object"}}
    jobs = [(kind, seed) for kind in formats for seed in SEEDS]
    results = _parallel(lambda job: client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, response_format=formats[job[0]],
        **_sampling(job[1])).choices[0], jobs)
    for (kind, seed), choice in zip(jobs, results):
        assert choice.finish_reason in ("stop", "length"), (kind, seed, choice)
        if kind == "json_schema":
            if choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.message.content), schema)
        elif choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut short: still the start of an object
            assert choice.message.content.startswith("{")


def test_regex_full_match_and_choice(client):
    patterns = [r"[a-z]{2,5}-\d{1,3}", r"(yes|no|maybe)!", r"0x[0-9a-f]{4}", r"[A-Z][a-z]* [A-Z][a-z]*\."]
    jobs = [(p, seed) for p in patterns for seed in SEEDS]
    results = _parallel(lambda job: _complete(client, seed=job[1], guided_regex=job[0]), jobs)
    stopped = 0
    for (pattern, seed), choice in zip(jobs, results):
        if choice.finish_reason == "stop":
            stopped += 1
            assert re.fullmatch(pattern, choice.text), (pattern, seed, choice.text)
    assert stopped >= len(jobs) // 2
    choices = ["red", "green", "blue sky", "ünïcode ✓"]
    grammar = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    constraints = {"choice": {"guided_choice": choices}, "grammar": {"guided_grammar": grammar}}
    jobs = [(kind, seed) for kind in constraints for seed in SEEDS]
    results = _parallel(lambda job: _complete(client, seed=job[1], **constraints[job[0]]), jobs)
    for (kind, seed), choice in zip(jobs, results):
        if kind == "choice":
            assert choice.finish_reason == "stop" and choice.text in choices, choice
        elif choice.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", choice.text), choice.text


def test_streaming_equals_non_streaming(client):
    model = client.models.list().data[0].id

    def streamed_and_full(job):
        seed, extra = job
        stream = client.completions.create(model=model, prompt="Answer:", max_tokens=MAX_TOKENS, stream=True,
                                           extra_body=extra, **_sampling(seed))
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, finish, _complete(client, seed=seed, **extra)

    # the jobs run side by side: each request's output does not depend on its batch
    jobs = [(seed, extra) for seed in (None, 7)
            for extra in ({"guided_json": SCHEMAS["optional_fields"]}, {"guided_regex": r"[a-z]{3,8}\d"})]
    for text, finish, full in _parallel(streamed_and_full, jobs):
        assert text == full.text and finish == [full.finish_reason]


def test_max_tokens_mid_object_is_length(client):
    cut_short = _parallel(lambda seed: _complete(client, seed=seed, max_tokens=3, guided_json=SCHEMAS["nested_object"]),
                          SEEDS)
    for choice in cut_short:
        assert choice.finish_reason == "length"
        assert choice.text.startswith("{")
        with pytest.raises(json.JSONDecodeError):
            json.loads(choice.text)


def test_unconstrained_request_unchanged_when_batched_with_constrained(client):
    def plain():
        return _complete(client, prompt="Once upon a time", max_tokens=24, return_token_ids=True).token_ids

    alone = plain()

    def job(i):
        if i == 0:
            time.sleep(0.05)  # join a batch already running constrained rows
            return plain()
        return _complete(client, seed=i, guided_json=SCHEMAS[list(SCHEMAS)[i % len(SCHEMAS)]], max_tokens=40)

    results = _parallel(job, range(6))
    assert results[0] == alone
