"""``mini-deepinfer run-batch`` / ``generate`` with OpenAI's batch format: each request served as the
HTTP server serves it (the same tokens as the offline API for the same seed; refusals name the
field, alone), results in OpenAI's batch output format and in input order; malformed lines are an
error naming the line before the engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from frontend.llm import LLM, SamplingParams

ENGINE_FLAGS = ["--device", "cpu", "--block-size", "16", "--num-blocks", "64", "--max-num-seqs", "4",
                "--max-model-len", "128"]
CHAT = [{"role": "user", "content": "Tell me a story"}]


def line(custom_id: str, url: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


REQUESTS = [
    line("plain", "/v1/completions", prompt="The quick brown fox", max_tokens=6, temperature=0.8, seed=5),
    line("choices", "/v1/completions", prompt="Once upon a time", max_tokens=4, n=2, seed=7, logprobs=1),
    line("chat", "/v1/chat/completions", messages=CHAT, max_completion_tokens=5, temperature=0.7, seed=3),
    line("refused", "/v1/completions", prompt="x", max_tokens=3, use_beam_search=True),
    line("bad-value", "/v1/chat/completions", messages=CHAT, top_p=0),
    line("tools", "/v1/chat/completions", messages=CHAT, max_tokens=2,
         tools=[{"type": "function", "function": {"name": "f"}}]),
    line("streamed", "/v1/completions", prompt="x", stream=True),
    line("named", "/v1/completions", model="tiny", prompt="Hello", max_tokens=2, temperature=0),
    line("other-model", "/v1/completions", model="gpt-4o-mini", prompt="Hello", max_tokens=2),
]


def run(tmp_path: Path, checkpoint, lines: list[str], command: str = "run-batch", *extra: str) -> tuple[int, Path]:
    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(entry + "\n" for entry in lines))
    out = tmp_path / "results.jsonl"
    code = main(["--log-level", "WARNING", command, "-i", str(inp), "-o", str(out), "--model", str(checkpoint),
                 "--no-progress", "--served-model-name", "tiny", *ENGINE_FLAGS, *extra])
    return code, out


@pytest.fixture(scope="module")
def results(tiny_checkpoint, tmp_path_factory) -> dict[str, dict]:
    code, out = run(tmp_path_factory.mktemp("batch"), tiny_checkpoint, REQUESTS[:4] + [""] + REQUESTS[4:])
    assert code == 0
    lines = [json.loads(text) for text in out.read_text().splitlines()]
    assert [r["custom_id"] for r in lines] == [json.loads(r)["custom_id"] for r in REQUESTS]  # input order
    assert len({r["id"] for r in lines}) == len(lines) and all(r["id"].startswith("batch_req_") for r in lines)
    return {r["custom_id"]: r for r in lines}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), device="cpu", block_size=16, num_blocks=64, max_num_seqs=4, max_model_len=128)


def body(result: dict) -> dict:
    assert result["response"]["status_code"] == 200 and result["error"] is None, result
    return result["response"]["body"]


def test_completions_are_the_servers_and_the_offline_apis(results, llm):
    plain = body(results["plain"])
    assert plain["object"] == "text_completion" and plain["model"] == "tiny"
    expected = llm.generate("The quick brown fox", SamplingParams(max_tokens=6, temperature=0.8, seed=5),
                            use_tqdm=False)[0].outputs[0]
    assert plain["choices"][0]["text"] == expected.text
    assert plain["usage"]["completion_tokens"] == len(expected.token_ids)
    assert results["plain"]["response"]["request_id"]

    choices = body(results["choices"])["choices"]
    want = llm.generate("Once upon a time", SamplingParams(max_tokens=4, n=2, seed=7, logprobs=1), use_tqdm=False)[0]
    assert [c["text"] for c in choices] == [o.text for o in want.outputs]
    assert [c["logprobs"]["tokens"] is not None for c in choices] == [True, True]


def test_chat_is_the_servers_and_the_offline_apis(results, llm):
    chat = body(results["chat"])
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    want = llm.chat(CHAT, SamplingParams(max_tokens=5, temperature=0.7, seed=3), use_tqdm=False)[0].outputs[0]
    assert chat["choices"][0]["message"]["content"] == want.text


@pytest.mark.parametrize("custom_id,status,param", [
    ("refused", 400, "use_beam_search"), ("bad-value", 400, "top_p"), ("tools", 400, "tool_choice"),
    ("streamed", 400, "stream"), ("other-model", 404, "model")])
def test_a_refused_request_fails_alone_naming_the_field(results, custom_id, status, param):
    result = results[custom_id]
    assert result["response"]["status_code"] == status
    error = result["response"]["body"]["error"]
    assert error["param"] == param and result["error"]["message"] == error["message"]
    assert result["error"]["code"]


def test_served_model_name_is_accepted(results):
    assert body(results["named"])["model"] == "tiny"


def test_generate_reads_the_batch_format_too(tiny_checkpoint, tmp_path):
    code, out = run(tmp_path, tiny_checkpoint, REQUESTS[:1], "generate")
    assert code == 0
    (result,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert result["custom_id"] == "plain" and body(result)["choices"][0]["finish_reason"] == "length"


def test_original_format_honours_stop_strings(tiny_checkpoint, tmp_path, llm):
    free = llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[3:5]
    code, out = run(tmp_path, tiny_checkpoint,
                    [json.dumps({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stop": [stop]})],
                    "generate")
    assert code == 0
    (result,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert result["text"] == text[:text.index(stop)] and result["finish_reason"] == "stop"


@pytest.mark.parametrize("bad,message", [
    ('{"custom_id": "a", "url": "/v1/embeddings", "body": {}}', "line 2: url must be one of"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "line 2: method must be POST"),
    ('{"custom_id": "", "url": "/v1/completions", "body": {}}', "line 2: custom_id"),
    ('{"custom_id": "b", "url": "/v1/completions", "body": "x"}', "line 2: body must be a JSON object"),
    ('{"custom_id": "b", "url": "/v1/completions", "body": {}, "prompt": "x"}', "line 2: unknown key(s) prompt"),
    (REQUESTS[0], "line 2: custom_id 'plain' is used twice"),
    ('{"prompt": "a"}', "line 2: every line of a file must have the same format"),
])
def test_a_malformed_line_is_an_error_naming_it(tiny_checkpoint, tmp_path, capsys, bad, message):
    code, out = run(tmp_path, tiny_checkpoint, [REQUESTS[0], bad])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
