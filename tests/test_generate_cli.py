"""``mini-deepinfer generate`` (alias ``run-batch``): JSONL in, one JSON result per line out, in input
order. The original format (a prompt per line): bad lines give a clear error naming the line and
exit code 2. OpenAI's batch format: every request is served as the HTTP server serves it (fields
honoured or refused with a 400 naming them, alone), results in OpenAI's batch output format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from engine_core.protocol import SamplingParams
from frontend.llm import LLM
from frontend.tokenizer import Tokenizer

ENGINE_FLAGS = ["--device", "cpu", "--block-size", "16", "--num-blocks", "64", "--max-num-seqs", "8",
                "--max-model-len", "128"]

REQUESTS = [
    {"prompt": "The quick brown fox", "max_tokens": 7, "temperature": 0},
    {"prompt_token_ids": [5, 6, 7, 8, 9, 10], "max_tokens": 3, "temperature": 0.8, "top_k": 10, "seed": 1,
     "logprobs": 2},
    {"prompt": "hello", "max_tokens": 0},
    {"prompt_token_ids": list(range(20, 60)), "max_tokens": 6, "min_tokens": 6, "stop_token_ids": [300, 301],
     "ignore_eos": True, "temperature": 1.0, "top_p": 0.9, "min_p": 0.05, "seed": 42},
    {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.7, "seed": 3, "presence_penalty": 0.5,
     "frequency_penalty": 0.3, "repetition_penalty": 1.2, "ignore_eos": True},
    {"prompt_token_ids": [11], "max_tokens": 2, "seed": 9},
]


def params_of(request: dict) -> SamplingParams:
    fields = {k: v for k, v in request.items() if k not in ("prompt", "prompt_token_ids")}
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    return SamplingParams(**fields)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_cli(tmp_path: Path, checkpoint: Path, lines: list[str], *extra: str) -> tuple[int, Path]:
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    code = main(["--log-level", "WARNING", "generate", "--input", str(inp), "--output", str(out),
                 "--model", str(checkpoint), "--no-progress", *ENGINE_FLAGS, *extra])
    return code, out


@pytest.fixture(scope="module")
def cli_results(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    lines = [json.dumps(REQUESTS[0]), "", *(json.dumps(r) for r in REQUESTS[1:3]), "   ",
             *(json.dumps(r) for r in REQUESTS[3:])]
    code, out = run_cli(tmp, tiny_checkpoint, lines)
    assert code == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_one_result_per_request_in_input_order(cli_results):
    assert len(cli_results) == len(REQUESTS)  # blank lines are skipped
    assert [r["index"] for r in cli_results] == list(range(len(REQUESTS)))
    for result, request in zip(cli_results, REQUESTS):
        assert {"index", "token_ids", "text", "finish_reason"} <= result.keys()
        assert isinstance(result["text"], str)
        assert all(isinstance(t, int) for t in result["token_ids"])
        assert len(result["token_ids"]) <= request["max_tokens"]
        assert result["finish_reason"] in ("stop", "length")


def test_fields_are_honoured(cli_results):
    assert cli_results[2]["token_ids"] == [] and cli_results[2]["finish_reason"] == "length"  # max_tokens 0
    assert len(cli_results[3]["token_ids"]) == 6 and cli_results[3]["finish_reason"] == "length"  # min_tokens
    assert not {300, 301} & set(cli_results[3]["token_ids"][:6])
    assert len(cli_results[4]["token_ids"]) == 5  # ignore_eos
    assert len(cli_results[1]["logprobs"]) == len(cli_results[1]["token_ids"])
    assert all(isinstance(x, float) and x <= 0.0 for x in cli_results[1]["logprobs"])
    assert all("logprobs" not in r for i, r in enumerate(cli_results) if i != 1)


def test_results_match_the_offline_api_and_the_tokenizer(cli_results, tiny_checkpoint):
    """Same prompts and parameters through ``LLM.generate``: the same tokens (text is tokenized with the
    checkpoint's tokenizer, every sampling field reaches the engine)."""
    tokenizer = Tokenizer(tiny_checkpoint)
    llm = LLM(str(tiny_checkpoint), device="cpu", block_size=16, num_blocks=64, max_num_seqs=8, max_model_len=128)
    prompts = [r.get("prompt_token_ids") or tokenizer.encode(r["prompt"]) for r in REQUESTS]
    expected = llm.generate(prompts, [params_of(r) for r in REQUESTS], use_tqdm=False)
    for i, (result, want) in enumerate(zip(cli_results, expected)):
        assert result["token_ids"] == want.token_ids, i
        assert result["finish_reason"] == want.finish_reason, i
        assert result["text"] == tokenizer.decode(want.token_ids), i
    assert [lp.logprob for lp in expected[1].logprobs] == cli_results[1]["logprobs"]


def test_text_and_token_id_prompts_agree(tiny_checkpoint, tmp_path):
    tokenizer = Tokenizer(tiny_checkpoint)
    ids = tokenizer.encode("The quick brown fox")
    code, out = run_cli(tmp_path, tiny_checkpoint, [
        json.dumps({"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}),
        json.dumps({"prompt_token_ids": ids, "max_tokens": 4, "temperature": 0})])
    assert code == 0
    a, b = [json.loads(line) for line in out.read_text().splitlines()]
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]


# ----------------------------------------------------------------------------- bad input
GOOD = json.dumps({"prompt": "fine", "max_tokens": 2})

BAD_LINES = [
    ("{not json", "line 2: not JSON"),
    ("[1, 2, 3]", "line 2: expected a JSON object"),
    ('"just a string"', "line 2: expected a JSON object"),
    ('{"max_tokens": 3}', "line 2: needs 'prompt'"),
    ('{"prompt": 5}', "line 2: needs 'prompt'"),
    ('{"prompt_token_ids": "5 6 7"}', "line 2: prompt_token_ids must be a list of integers"),
    ('{"prompt_token_ids": [5, "6"]}', "line 2: prompt_token_ids must be a list of integers"),
    ('{"prompt": "a", "temperature": -1}', "line 2: temperature"),
    ('{"prompt": "a", "prompt_token_ids": [5]}', "line 2: give one of prompt, prompt_token_ids"),
    ('{"prompt": "a", "n": 2}', "line 2: n: several choices need the OpenAI batch format"),
    ('{"prompt": "a", "use_beam_search": true}', "line 2: use_beam_search"),
    ('{"prompt": "a", "top_p": 0}', "line 2: top_p"),
    ('{"prompt": "a", "top_k": -2}', "line 2: top_k"),
    ('{"prompt": "a", "max_tokens": -1}', "line 2: max_tokens"),
    ('{"prompt": "a", "repetition_penalty": 0}', "line 2: repetition_penalty"),
    ('{"prompt": "a", "max_tokens": "ten"}', "line 2:"),
]


@pytest.mark.parametrize("line,message", BAD_LINES)
def test_bad_line_is_a_clear_error_with_exit_code_2(tiny_checkpoint, tmp_path, capsys, line, message):
    code, out = run_cli(tmp_path, tiny_checkpoint, [GOOD, line, GOOD])
    assert code == 2
    err = capsys.readouterr().err
    assert "mini-deepinfer generate: error:" in err and message in err, err
    assert not out.exists()


@pytest.mark.parametrize("line,message", [
    ('{"prompt_token_ids": [5, 99999]}', "token id 99999 in prompt is out of range"),
    ('{"prompt_token_ids": []}', "empty"),
    (json.dumps({"prompt_token_ids": [7] * 128}), "maximum context length is 128 tokens"),  # --max-model-len 128
])
def test_prompt_refused_by_the_server_exits_2_and_names_the_line(tiny_checkpoint, tmp_path, capsys, line, message):
    code, out = run_cli(tmp_path, tiny_checkpoint, [GOOD, line, GOOD])
    assert code == 2
    err = capsys.readouterr().err
    assert "mini-deepinfer generate: error: line 2:" in err and message in err, err
    assert not out.exists()


@pytest.mark.parametrize("line,field", [
    ('{"prompt": "a", "seed": "abc"}', "seed"),
    ('{"prompt": "a", "stop_token_ids": 5}', "stop_token_ids"),
    ('{"prompt": "a", "stop_token_ids": ["x"], "min_tokens": 2}', "stop_token_ids"),
    ('{"prompt": "a", "max_tokens": true}', "max_tokens"),
    ('{"prompt": "a", "top_k": 2.5}', "top_k"),
    ('{"prompt": "a", "ignore_eos": "no"}', "ignore_eos"),
    ('{"prompt": "a", "temperature": "0.5"}', "temperature"),
])
def test_badly_typed_field_is_a_clear_error(tiny_checkpoint, tmp_path, capsys, line, field):
    code, out = run_cli(tmp_path, tiny_checkpoint, [GOOD, line])
    assert code == 2
    err = capsys.readouterr().err
    assert f"mini-deepinfer generate: error: line 2: {field}" in err, err
    assert not out.exists()


def test_missing_input_file_exits_2(tiny_checkpoint, tmp_path, capsys):
    code = main(["--log-level", "WARNING", "generate", "--input", str(tmp_path / "nope.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), "--model", str(tiny_checkpoint), *ENGINE_FLAGS])
    assert code == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_line_numbers_count_blank_lines(tiny_checkpoint, tmp_path, capsys):
    code, _ = run_cli(tmp_path, tiny_checkpoint, [GOOD, "", '{"prompt": "a", "top_p": 2}'])
    assert code == 2
    assert "line 3: top_p" in capsys.readouterr().err
