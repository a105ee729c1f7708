"""/v1/chat/completions, /tokenize, /detokenize and /tokenizer_info against the fake engine."""

from __future__ import annotations

import httpx
import openai
import pytest


MODEL = "fake-chat"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


def test_chat_non_streaming(client, served, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, seed=4)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 9
    engine = served[1]
    sent = [p for p, _ in engine.received.values() if p == prompt_ids]
    assert sent and prompt_ids.count(tokenizer.bos_token_id) == 1  # the template's bos, not a second one


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=25, seed=8, n=2, stop=["qq"])
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts: dict[int, str] = {}
    per_choice: dict[int, list] = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.usage is None
        for c in chunk.choices:
            per_choice.setdefault(c.index, []).append(c)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    for index, parts in per_choice.items():
        assert parts[0].delta.role == "assistant"
        assert all(p.delta.role is None for p in parts[1:])
        assert all(p.finish_reason is None for p in parts[:-1])
        assert parts[-1].finish_reason == full.choices[index].finish_reason
        assert texts[index] == full.choices[index].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_default_max_tokens_fills_the_context(client, served):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=1, stop=["e"])
    params = [p for _, p in served[1].received.values()][-1]
    assert params.max_tokens == 4096 - r.usage.prompt_tokens


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, seed=2, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0 and isinstance(entry.bytes, list)
        assert entry.top_logprobs[0].token == entry.token  # the fake samples its top-1
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, seed=2, logprobs=True,
                                            top_logprobs=3, stream=True)
    streamed = [e.token for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == [e.token for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_content_parts_and_developer_role(client):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, seed=4)
    assert r.choices[0].message.content


def test_tokenize_detokenize_and_info(served, tokenizer):
    url = served[0].url
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 4096
    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    rendered = tokenizer.apply_chat_template(MESSAGES)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token_id"] == tokenizer.eos_token_id and info["bos_token"] == tokenizer.bos_token
    assert info["vocab_size"] == tokenizer.vocab_size and info["chat_template"] == tokenizer.chat_template
    assert info["max_model_len"] == 4096
