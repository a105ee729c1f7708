"""/v1/completions through the official OpenAI client against a real uvicorn server whose engine
is the FakeEngineClient (deterministic tokens, zero model time)."""

from __future__ import annotations

import httpx
import openai
import pytest


MODEL = "fake-model"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


def stream_choices(client, **kwargs) -> tuple[dict[int, str], dict[int, list], list]:
    """Streamed text per choice index, the chunks per choice, and all chunks."""
    texts: dict[int, str] = {}
    per_choice: dict[int, list] = {}
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            per_choice.setdefault(c.index, []).append(c)
    return texts, per_choice, chunks


def test_non_streaming_basics_and_exact_usage(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=7)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    default = client.completions.create(model=MODEL, prompt=PROMPT, seed=7)
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens


def test_streaming_equals_non_streaming_and_finish_only_last(client):
    kwargs = dict(prompt=PROMPT, max_tokens=30, seed=11, n=3, stop=["zz", "\n\n"])
    full = client.completions.create(model=MODEL, **kwargs)
    texts, per_choice, chunks = stream_choices(client, **kwargs)
    assert {c.index: c.text for c in full.choices} == texts
    for index, parts in per_choice.items():
        assert all(p.finish_reason is None for p in parts[:-1])
        assert parts[-1].finish_reason == full.choices[index].finish_reason
    assert all(chunk.usage is None for chunk in chunks)  # no include_usage: no usage at all


def test_stream_usage_chunk(client, tokenizer):
    texts, _, chunks = stream_choices(client, prompt=[PROMPT, "Another prompt"], n=2, max_tokens=5, seed=1,
                                      stream_options={"include_usage": True})
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(chunk.usage is None for chunk in chunks[:-1])
    prompt_tokens = len(tokenizer.encode(PROMPT)) + len(tokenizer.encode("Another prompt"))
    assert last.usage.prompt_tokens == prompt_tokens  # once per prompt, whatever n
    assert last.usage.completion_tokens == 4 * 5
    assert sorted(texts) == [0, 1, 2, 3]


def test_n_choices_are_seed_plus_index(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=100, n=3)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=100, n=3)
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    for i in range(3):
        single = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=100 + i)
        assert single.choices[0].text == texts[i]
    unseeded = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=2)
    assert unseeded.choices[0].text != unseeded.choices[1].text


def test_token_id_prompts_and_choice_order(client, tokenizer):
    a, b = tokenizer.encode("first prompt"), tokenizer.encode("second one, longer")
    r = client.completions.create(model=MODEL, prompt=[a, b], max_tokens=4, n=2, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(a) + len(b)
    single = client.completions.create(model=MODEL, prompt=b, max_tokens=4, seed=5)
    assert single.choices[0].text == r.choices[2].text  # prompt 1, choice 0 -> index 2
    text_prompt = client.completions.create(model=MODEL, prompt="second one, longer", max_tokens=4, seed=5)
    assert text_prompt.choices[0].text == single.choices[0].text


def _find_boundary_stop(tokenizer, token_ids: list[int], text: str) -> tuple[str, int]:
    """A stop string spanning two tokens, that first occurs there; and how many tokens precede it."""
    pieces = [tokenizer.decode([t]) for t in token_ids]
    for k in range(1, len(pieces) - 6):
        left, right = pieces[k], pieces[k + 1]
        if len(left) >= 2 and len(right) >= 2 and "\ufffd" not in left + right:
            stop = left[-2:] + right[:2]
            prefix = tokenizer.decode(token_ids[:k + 1])[:-2]
            if text.find(stop) == len(prefix):
                return stop, k + 2
    pytest.skip("no suitable token boundary in this output")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens_aborts_engine(client, served, tokenizer, stream):
    server, engine = served
    base = httpx.post(server.url + "/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 60, "seed": 21, "return_token_ids": True}).json()
    token_ids, text = base["choices"][0]["token_ids"], base["choices"][0]["text"]
    assert text == tokenizer.decode(token_ids)
    stop, _ = _find_boundary_stop(tokenizer, token_ids, text)
    aborted_before = engine.num_aborted
    if stream:
        texts, per_choice, _ = stream_choices(client, prompt=PROMPT, max_tokens=60, seed=21, stop=[stop])
        got, last = texts[0], per_choice[0][-1]
    else:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, seed=21, stop=stop)
        got, last = r.choices[0].text, r.choices[0]
        assert r.usage.completion_tokens < 60
    assert got == text[:text.index(stop)] and stop not in got
    assert last.finish_reason == "stop" and last.model_extra.get("stop_reason") == stop
    assert engine.num_aborted == aborted_before + 1  # the engine request did not run on to max_tokens


def test_stop_token_ids(client, tokenizer):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, seed=3,
                                     extra_body={"return_token_ids": True})
    ids = base.choices[0].model_extra["token_ids"]
    stop_token = ids[6]
    cut = ids.index(stop_token)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, seed=3,
                                  extra_body={"stop_token_ids": [stop_token]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop_token
    assert r.usage.completion_tokens == cut + 1  # the stop token counts ...
    assert r.choices[0].text == tokenizer.decode(ids[:cut])  # ... but is not part of the text


def test_logprobs_shapes_and_consistency(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=9, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and 1 <= len(top) <= 4 and logprob <= 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    texts, per_choice, _ = stream_choices(client, prompt=PROMPT, max_tokens=8, seed=9, logprobs=3)
    streamed = [t for c in per_choice[0] if c.logprobs for t in c.logprobs.tokens]
    streamed_offsets = [o for c in per_choice[0] if c.logprobs for o in c.logprobs.text_offset]
    assert streamed == lp.tokens and streamed_offsets == lp.text_offset
    none = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, seed=9, logprobs=0)
    assert all(len(top) == 1 for top in none.choices[0].logprobs.top_logprobs)


def test_echo_with_logprobs_like_lm_eval_harness(client, tokenizer):
    """lm-evaluation-harness local-completions: token-id prompts, echo, max_tokens 1, logprobs 1."""
    contexts = [tokenizer.encode("The capital of France is"), tokenizer.encode("Two plus two equals")]
    prompts = [ctx + tokenizer.encode(" Paris", add_special_tokens=False) for ctx in contexts]
    r = client.completions.create(model=MODEL, prompt=prompts, echo=True, max_tokens=1, logprobs=1,
                                  temperature=0.0, seed=1234)
    for choice, prompt in zip(sorted(r.choices, key=lambda c: c.index), prompts):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        continuation = lp.token_logprobs[len(prompt) - 1:-1]
        assert all(isinstance(x, float) for x in continuation)
        for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert top[token] == logprob
        assert choice.text.startswith(tokenizer.decode(prompt))
    zero = client.completions.create(model=MODEL, prompt=prompts[0], echo=True, max_tokens=0, logprobs=1)
    assert zero.choices[0].text == tokenizer.decode(prompts[0]) and zero.usage.completion_tokens == 0
    assert len(zero.choices[0].logprobs.tokens) == len(prompts[0])
    plain = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].finish_reason == "length"
    texts, _, _ = stream_choices(client, prompt=PROMPT, echo=True, max_tokens=4, seed=2)
    full = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=4, seed=2)
    assert texts[0] == full.choices[0].text and texts[0].startswith(PROMPT)


def test_sampling_fields_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.2, logit_bias={"17": 5}, best_of=1, user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
                    "unknown_field": {"whatever": 1}})
    assert r.usage.completion_tokens == 4


def test_model_field_optional_and_models_endpoint(served):
    server, _ = served
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 4096
