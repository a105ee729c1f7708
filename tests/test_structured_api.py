"""Structured output at the API: every request form maps to one ``SamplingParams.structured``, and
every bad constraint is refused with a 400 naming the problem before it reaches the engine (real
HTTP server, fake engine, constraints compiled with xgrammar against the tiny model's tokenizer)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from engine_core.protocol import StructuredOutput
from frontend.openai_types import CompletionRequest
from frontend.structured_output import (GrammarValidator, check_schema_features, choice_grammar,
                                        structured_from_request)

pytest.importorskip("xgrammar")

MODEL = "fake-model"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))
MESSAGES = [{"role": "user", "content": "Give me JSON"}]


@pytest.fixture(scope="module")
def base(served) -> str:
    return served[0].url


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def _post(base: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/{route}", json=body, timeout=30)


def _last_structured(engine) -> StructuredOutput | None:
    return list(engine.received.values())[-1][1].structured


def _completion(base, **fields) -> httpx.Response:
    return _post(base, "completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields})


def _chat(base, **fields) -> httpx.Response:
    return _post(base, "chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields})


MAPPINGS = [
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json_schema", SCHEMA_TEXT)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
     StructuredOutput("json_schema", SCHEMA_TEXT)),
    ({"guided_json": SCHEMA}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    ({"guided_regex": r"[a-z]{3}\d"}, StructuredOutput("regex", r"[a-z]{3}\d")),
    ({"guided_choice": ["yes", "no", "ünïcode"]}, StructuredOutput("choice", '["yes", "no", "ünïcode"]')),
    ({"guided_grammar": 'root ::= "a" | "b" "c"*'}, StructuredOutput("grammar", 'root ::= "a" | "b" "c"*')),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    ({"structured_outputs": {"regex": "x+"}}, StructuredOutput("regex", "x+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput("choice", '["a", "b"]')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", "")),
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("fields,expected", MAPPINGS, ids=[json.dumps(m[0])[:40] for m in MAPPINGS])
def test_each_form_maps_to_structured_output(base, served, route, fields, expected):
    r = (_completion if route == "completions" else _chat)(base, **fields)
    assert r.status_code == 200, r.text
    assert _last_structured(served[1]) == expected


def test_openai_client_response_format_and_extra_body(client, served):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}})
    assert _last_structured(served[1]) == StructuredOutput("json_schema", SCHEMA_TEXT)
    client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body={"guided_choice": ["up", "down"]})
    assert _last_structured(served[1]) == StructuredOutput("choice", '["up", "down"]')
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
                                            response_format={"type": "json_object"})
    assert list(stream)
    assert _last_structured(served[1]) == StructuredOutput("json_object", "")


BAD = [
    # (fields, status, words the message must contain)
    ({"guided_json": {"type": "nonsense"}}, ["guided_json", "nonsense"]),
    ({"guided_json": [1, 2]}, ["guided_json", "JSON schema object", "array"]),
    ({"guided_json": "{not json"}, ["guided_json", "not valid JSON"]),
    ({"guided_json": "[1]"}, ["guided_json", "JSON schema object"]),
    ({"guided_json": 7}, ["guided_json", "a number"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     ["response_format", "nonsense"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "string"}}},
     ["response_format.json_schema.schema", "JSON schema object"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, ["schema is required"]),
    ({"response_format": {"type": "json_schema"}}, ["response_format.json_schema is required"]),
    ({"response_format": {"type": "xml"}}, ["response_format.type"]),
    ({"response_format": "json"}, ["response_format"]),
    ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}}, ["only allowed"]),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}}, ["guided_json", "minimum greater than maximum"]),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, ["guided_json", "missing"]),
    ({"guided_json": {"not": {"type": "string"}}}, ["unsupported JSON schema feature", "'not'"]),
    ({"guided_json": {"type": "object", "properties": {"a": {"if": {"type": "string"}, "then": {}}}}},
     ["unsupported", "#/properties/a", "'if'"]),
    ({"guided_json": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}, ["unsupported", "allOf"]),
    ({"guided_json": {"type": "number", "multipleOf": 0.5}}, ["unsupported", "multipleOf"]),
    ({"guided_json": {"type": "string", "format": "iri"}}, ["unsupported", "'iri'"]),
    ({"guided_json": {"type": "string", "pattern": "a+", "maxLength": 2}}, ["unsupported", "pattern"]),
    ({"guided_json": {"type": "string", "pattern": "(["}}, ["guided_json", "Unclosed"]),
    ({"guided_regex": "(unclosed"}, ["invalid regex in guided_regex", "parenthesis"]),
    ({"guided_regex": ""}, ["guided_regex must not be empty"]),
    ({"guided_regex": 5}, ["guided_regex"]),
    ({"guided_grammar": 'root ::= "a" | '}, ["invalid grammar in guided_grammar", "line 1"]),
    ({"guided_grammar": "root ::= undefined_rule"}, ["guided_grammar", "undefined_rule"]),
    ({"guided_grammar": "no rules at all"}, ["invalid grammar in guided_grammar"]),
    ({"guided_choice": []}, ["guided_choice must list at least one choice"]),
    ({"guided_choice": ["a", ""]}, ["guided_choice entries must be non-empty"]),
    ({"guided_choice": "a"}, ["guided_choice"]),
    ({"guided_choice": ["a", 1]}, ["guided_choice"]),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, ["at most one", "guided_regex", "guided_choice"]),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, ["at most one", "response_format",
                                                                         "guided_json"]),
    ({"guided_grammar": 'root ::= "a"', "structured_outputs": {"regex": "a"}}, ["at most one"]),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, ["at most one"]),
    ({"structured_outputs": {"json": "{bad"}}, ["structured_outputs.json", "not valid JSON"]),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("fields,words", BAD, ids=[json.dumps(b[0])[:50] for b in BAD])
def test_bad_constraints_are_400_naming_the_problem(base, served, route, fields, words):
    engine = served[1]
    before = engine.num_requests
    r = (_completion if route == "completions" else _chat)(base, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]
    assert engine.num_requests == before  # never reached the engine
    assert "/project/" not in error["message"] and ".cc:" not in error["message"]  # no C++ source paths


def test_server_healthy_after_bad_constraints(base, served, client):
    for fields in (b[0] for b in BAD[:10]):
        _completion(base, **fields)
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, extra_body={"guided_regex": "[ab]+"})
    assert r.choices[0].finish_reason == "length"
    assert _last_structured(served[1]) == StructuredOutput("regex", "[ab]+")
    # a repeated bad constraint is answered from the verdict cache, with the same message
    first, second = (_completion(base, guided_regex="(unclosed").json() for _ in range(2))
    assert first == second


def test_structured_requests_in_parallel(base, served):
    """Distinct schemas compiled at once: all accepted (they wait for a compile thread, no 503)."""
    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            bodies = [{"model": MODEL, "prompt": "x", "max_tokens": 2,
                       "guided_json": {"type": "object", "properties": {f"k{i}": {"type": "integer", "maximum": i}},
                                       "required": [f"k{i}"]}} for i in range(12)]
            return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 12


def test_compile_timeout_is_a_clear_400(tokenizer):
    validator = GrammarValidator(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_id, timeout_s=0.05)
    import time

    real_compile = validator._compile
    validator._compile = lambda kind, spec: (time.sleep(0.5), real_compile(kind, spec))[1]
    from frontend.errors import APIError

    async def run():
        with pytest.raises(APIError) as info:
            await validator.validate(StructuredOutput("regex", "a+"), "guided_regex")
        return info.value

    error = asyncio.run(run())
    assert error.status == 400 and "did not compile within 0.05 s" in error.message and error.param == "guided_regex"
    validator.close()


def test_units_schema_walk_and_choice_grammar():
    check_schema_features({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},
                          "guided_json")  # property *names* that look like keywords are fine
    check_schema_features({"$defs": {"a": {"type": "integer", "multipleOf": 3}}, "$ref": "#/$defs/a"}, "guided_json")
    from frontend.errors import APIError

    with pytest.raises(APIError, match="#/items/0/anyOf/1"):
        check_schema_features({"type": "array", "items": [{"anyOf": [{}, {"not": {}}]}]}, "guided_json")
    deep: dict = {"type": "integer"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    with pytest.raises(APIError, match="nested deeper"):
        check_schema_features(deep, "guided_json")
    assert choice_grammar(['say "hi"', "b\\c"]) == 'root ::= "say \\"hi\\"" | "b\\\\c"'
    req = CompletionRequest.model_validate_json('{"prompt": "x", "guided_choice": ["a"], "response_format": '
                                                '{"type": "text"}}')
    assert structured_from_request(req) == StructuredOutput("choice", '["a"]')
