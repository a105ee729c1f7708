"""Structured output in the engine: grammars compiled with xgrammar, masks applied in the worker.

With the tiny default model (random weights: only the grammar keeps its text in shape) every
finished constrained output must parse and validate, unconstrained neighbours must get exactly
the tokens they get alone, and preemption, n > 1 (several sequences of one spec) and zero-overhead
scheduling on and off must not change any of it. An invalid spec ends its own request only.

Text parses with ``json.loads(strict=False)``: xgrammar's JSON string rule lets raw control
characters (U+0000-U+001F other than the escaped ones) through, which strict JSON forbids, and a
random model does produce them.
"""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import pytest

from engine_core.protocol import SamplingParams, StructuredOutput
from frontend.llm import LLM

BASE = dict(block_size=16, max_num_seqs=16, num_blocks=80, max_num_batched_tokens=512)
TIGHT = dict(BASE, num_blocks=10, num_state_slots=3)  # 144 tokens per rank: forces preemption and recomputation

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
            "required": ["id", "tags"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum_bounds": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
        "ok": {"type": "boolean"}},
        "required": ["color", "score", "ok"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": 1, "maxItems": 3},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
}
PROMPTS = [[3 + (5 + i * 31 + j * 7) % 1000 for j in range(5 + 3 * i)] for i in range(8)]


def so_schema(name: str) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))


def constrained_params(name: str, i: int, max_tokens: int = 60) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=so_schema(name))
    return SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i, max_tokens=max_tokens, structured=so_schema(name))


def check_json(result, schema: dict) -> None:
    assert not result.error
    if result.finish_reason == "length":
        return  # stopped mid-object by max_tokens: "length", as without a grammar
    assert result.finish_reason == "stop", result
    value = json.loads(result.text, strict=False)
    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def llm_zos():
    return LLM(**BASE)


@pytest.fixture(scope="module")
def llm_no_zos():
    return LLM(zos=False, **BASE)


@pytest.fixture(params=["zos", "no_zos"])
def llm(request, llm_zos, llm_no_zos):
    return llm_zos if request.param == "zos" else llm_no_zos


def test_json_schemas_greedy_and_sampled(llm):
    names = list(SCHEMAS)
    requests = [(names[i % len(names)], i) for i in range(8)]
    results = llm.generate(PROMPTS, [constrained_params(name, i) for name, i in requests], use_tqdm=False)
    stopped = 0
    for (name, _), result in zip(requests, results):
        check_json(result, SCHEMAS[name])
        stopped += result.finish_reason == "stop"
    assert stopped >= 5, [r.text for r in results]


def test_json_object_regex_choice_and_grammar(llm):
    choices = ["alpha", "beta gamma", "δ"]
    specs = [StructuredOutput("json_object"), StructuredOutput("regex", r"[a-c]{2}-\d{1,3}"),
             StructuredOutput("choice", json.dumps(choices)),
             StructuredOutput("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+ | "x"')]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=60, structured=so)
              for so in specs for t, s in ((0.0, None), (1.0, 5))]
    results = llm.generate(PROMPTS, params, use_tqdm=False)
    for p, r in zip(params, results):
        assert not r.error
        kind = p.structured.kind
        if kind == "regex":
            assert r.finish_reason == "stop" and re.fullmatch(r"[a-c]{2}-\d{1,3}", r.text), r.text
        elif kind == "choice":
            assert r.finish_reason == "stop" and r.text in choices, r.text
        elif kind == "grammar" and r.finish_reason == "stop":
            assert re.fullmatch(r"\((\d+|x)(,(\d+|x))*\)", r.text), r.text
        elif kind == "json_object" and r.finish_reason == "stop":
            assert isinstance(json.loads(r.text, strict=False), dict)


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=1.0, seed=9, max_tokens=12),
            SamplingParams(temperature=0.8, top_k=30, seed=3, max_tokens=12, presence_penalty=0.5)]
    alone = llm.generate(PROMPTS[:3], free, use_tqdm=False)
    mixed_params = [free[0], constrained_params("nested", 0), free[1], constrained_params("array", 1), free[2]]
    mixed_prompts = [PROMPTS[0], PROMPTS[5], PROMPTS[1], PROMPTS[6], PROMPTS[2]]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [r.token_ids for r in alone] == [mixed[0].token_ids, mixed[2].token_ids, mixed[4].token_ids]
    check_json(mixed[1], SCHEMAS["nested"])
    check_json(mixed[3], SCHEMAS["array"])


def test_constrained_tokens_do_not_depend_on_the_batch(llm):
    params = [constrained_params("enum_bounds", i) for i in range(4)]
    alone = [llm.generate([PROMPTS[i]], [params[i]], use_tqdm=False)[0].token_ids for i in range(2)]
    batch = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [r.token_ids for r in batch[:2]] == alone


@pytest.mark.parametrize("zos", [True, False])
def test_preemption_keeps_outputs_valid_and_identical(llm_zos, zos):
    names = list(SCHEMAS)
    params = [constrained_params(names[i % len(names)], i, max_tokens=40) for i in range(6)]
    params[3] = SamplingParams(temperature=1.0, seed=77, max_tokens=40)  # one unconstrained among them
    prompts = [p * 3 for p in PROMPTS[2:]]  # 33 .. 78 tokens: each fits alone, not all together
    tight = LLM(zos=zos, **TIGHT)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats().preemptions > 0, "the tight configuration must actually preempt"
    want = llm_zos.generate(prompts, params, use_tqdm=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for i, r in enumerate(got):
        if i != 3:
            check_json(r, SCHEMAS[names[i % len(names)]])
    assert tight.engine.scheduler.stats().kv_blocks_used == 0


def test_n_sequences_of_one_spec(llm):
    """n > 1 reaches the engine as n sequences with one spec (compiled once) and their own seeds."""
    so = so_schema("enum_bounds")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured=so) for s in range(6)]
    results = llm.generate([PROMPTS[2]] * 6, params, use_tqdm=False)
    for r in results:
        check_json(r, SCHEMAS["enum_bounds"])
    assert len({tuple(r.token_ids) for r in results}) > 1


def test_invalid_spec_ends_only_its_request(llm):
    bad = [StructuredOutput("json_schema", "{not json"), StructuredOutput("regex", "(unclosed"),
           StructuredOutput("grammar", "root ::= undefined_rule"), StructuredOutput("choice", "[]"),
           StructuredOutput("no_such_kind", "")]
    params = [SamplingParams(temperature=0.0, max_tokens=8, structured=so) for so in bad]
    params.insert(2, SamplingParams(temperature=0.0, max_tokens=8))
    params.append(constrained_params("array", 0))
    results = llm.generate(PROMPTS[:len(params)], params, use_tqdm=False)
    for p, r in zip(params, results):
        if p.structured is None:
            assert r.finish_reason == "length" and len(r.token_ids) == 8 and not r.error
        elif p.structured.kind == "json_schema" and p.structured.spec.startswith("{\""):
            check_json(r, SCHEMAS["array"])
        else:
            assert r.finish_reason == "abort" and r.error and r.token_ids == [], (p, r)
    assert not llm.engine.has_work


def test_max_tokens_mid_object_is_length(llm):
    r = llm.generate([PROMPTS[0]], [constrained_params("nested", 0, max_tokens=3)], use_tqdm=False)[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 3 and r.text.startswith("{")


def test_eos_only_where_the_grammar_may_end(llm):
    """ignore_eos off and a grammar that can end early: EOS never cuts the text short of the grammar."""
    so = StructuredOutput("regex", r"(ab)+")
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=30, structured=so) for s in range(6)]
    for r in llm.generate([PROMPTS[1]] * 6, params, use_tqdm=False):
        if r.finish_reason == "stop":
            assert re.fullmatch(r"(ab)+", r.text), r.text
        else:
            assert re.fullmatch(r"(ab)*a?", r.text), r.text


def test_a_finished_grammar_wins_over_min_tokens(llm, caplog):
    """A choice ends after a few tokens; min_tokens beyond that must not leave the row with no
    allowed token (every logit -inf, then a token outside the grammar is sampled): the grammar's
    EOS is kept until min_tokens is reached, and the text is the choice."""
    choices = ["yes", "no"]
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10,
                            structured=StructuredOutput("choice", json.dumps(choices)))
    with caplog.at_level(logging.WARNING, logger="workers.structured_output"):
        r = llm.generate([PROMPTS[0]], [params], use_tqdm=False)[0]
    assert not r.error and r.finish_reason == "stop" and r.text in choices, (r.text, r.finish_reason)
    assert not [m for m in caplog.messages if "outside its grammar" in m], caplog.messages


def test_workers_compile_a_grammar_when_its_request_is_admitted():
    """The engine core's "grammar" broadcast starts the worker's compile before any step needs it."""
    from engine_core.ipc import DropLog
    from engine_core.protocol import MessageType, StructuredOutput, WorkerControl, encode
    from workers.step_pipeline import StepPipeline
    from workers.worker_process import handle_message

    submitted = []

    class Cache:
        def submit(self, structured):
            submitted.append(structured)

    class Runner:
        class structured:  # noqa: N801 - stands in for the runner's StructuredState
            cache = Cache()

    spec = StructuredOutput("regex", "[ab]+")
    frames = [MessageType.CONTROL.value, encode(WorkerControl("grammar", grammar=spec))]
    assert handle_message(frames, StepPipeline(Runner(), 0, None, one_ahead=False), DropLog("test"))
    assert submitted == [spec]
