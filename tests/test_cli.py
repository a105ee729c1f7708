"""The ``mini-deepinfer`` command line: every flag of every subcommand documented with its default
(in ``--help`` and in docs/configuration.md, which must match), vLLM's flag names, ``--log-level``
before or after the subcommand, and configuration errors as one line with exit code 2."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version

import pytest
from server_harness import REPO, alive, children, free_port, process_name

from deploy.cli import COMMANDS, build_parser, main
from engine_core.cli_options import default_text

SUBCOMMANDS = [*COMMANDS, *(alias for aliases, _ in COMMANDS.values() for alias in aliases)]


def _subparser(name: str | None) -> argparse.ArgumentParser:
    parser = build_parser()
    if name is None:
        return parser
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def _help_text(argv: list[str], capsys) -> str:
    os.environ["COLUMNS"] = "100"
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _help_entries(text: str) -> dict[str, str]:
    """Each option's (or positional's) entry in --help, keyed by its first line's invocation."""
    entries: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if re.match(r"^  \S", line):  # "  --flag ARG   help..." or "  POSITIONAL   help..."
            key = line.split("  ")[1].strip()
            entries[key] = line[len(key) + 2:].strip()
        elif key is not None and line.startswith("      ") and line.strip():
            entries[key] += " " + line.strip()
        elif not line.strip() or not line.startswith(" "):
            key = None
    return entries


@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help_shows_every_flag_with_help_and_default(command, capsys):
    parser = _subparser(command)
    entries = _help_entries(_help_text([command] if command else [], capsys))
    checked = 0
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        invocation = next((k for k in entries if k.split(" ")[0].rstrip(",") == (action.option_strings or
                                                                                  [action.metavar])[0]), None)
        assert invocation is not None, f"{action.option_strings or action.metavar} missing from --help"
        text = entries[invocation]
        assert action.help and len(action.help) > 5, f"{invocation}: no help text"
        if action.option_strings and not isinstance(action, argparse._VersionAction):
            assert re.search(r"\((default: [^)]+|required)\)", text), f"{invocation}: no default in {text!r}"
        checked += 1
    assert checked >= {None: 2, "serve": 40, "generate": 25}.get(command, 3)


def test_configuration_doc_matches_the_cli():
    from deploy.config_doc import DOC_PATH, render

    assert DOC_PATH.read_text() == render(), "docs/configuration.md is stale: python -m deploy.config_doc --write"
    doc = DOC_PATH.read_text()
    for command in SUBCOMMANDS:
        for action in _subparser(command)._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in doc, flag
            if action.option_strings and default_text(action) not in (None, "required"):
                assert f"`{default_text(action)}`" in doc


def test_version_comes_from_the_package(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mini-deepinfer {version('mini-deepinfer')}"


@pytest.mark.parametrize("argv, level", [
    (["serve"], "INFO"),
    (["--log-level", "warning", "serve"], "WARNING"),
    (["serve", "--log-level", "debug"], "DEBUG"),
    (["--log-level", "ERROR", "generate", "--input", "a", "--output", "b", "--log-level", "WARNING"], "WARNING"),
    (["--log-level", "ERROR", "parity", "--golden", "g"], "ERROR"),
    (["make-checkpoint", "out", "--log-level", "CRITICAL"], "CRITICAL"),
])
def test_log_level_before_or_after_the_subcommand(argv, level):
    assert build_parser().parse_args(argv).log_level == level


def test_vllm_flag_names_fill_the_engine_config(tiny_checkpoint):
    from engine_core.config import engine_config_from_args

    args = build_parser().parse_args(["serve", str(tiny_checkpoint), "-dp", "2", "--seed", "7", "--enforce-eager",
                                      "--max-model-len", "1024", "--no-zos", "--device", "cpu",
                                      # a DeepSeek recipe's flags: accepted (engine_core/vllm_recipe_flags.py)
                                      "--trust-remote-code", "--enable-expert-parallel", "-tp", "1",
                                      "--kv-cache-dtype", "fp8"])
    config = engine_config_from_args(args)
    assert (config.model, config.dp_size, config.seed, config.enforce_eager, config.max_model_len, config.zos) == \
        (str(tiny_checkpoint), 2, 7, True, 1024, False)
    for spelling in (["--data-parallel-size", "2"], ["--dp", "2"]):
        assert build_parser().parse_args(["serve", *spelling]).dp_size == 2
    server = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert server.served_model_name == ["a", "b"]
    assert build_parser().parse_args(["run-batch", "--input", "a", "--output", "b"]).command_name == "generate"


def test_device_defaults_to_cuda_when_torch_sees_one(tiny_checkpoint, monkeypatch):
    """``serve`` without ``--device`` runs where its help says: cuda if available, else cpu (the
    engine config's own default, cpu, is for programs that build it directly)."""
    import torch

    from engine_core.config import engine_config_from_args

    def device(available: bool) -> str:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: int(available))
        return engine_config_from_args(build_parser().parse_args(["serve", str(tiny_checkpoint)])).device

    assert (device(True), device(False)) == ("cuda", "cpu")
    assert build_parser().parse_args(["serve", "--device", "cpu"]).device == "cpu"


@pytest.mark.parametrize("argv, message", [
    (["serve", "/no/such/model"], "model directory /no/such/model does not exist"),
    (["serve", "{ckpt}", "--max-model-len", "5000"], "--max-model-len 5000 is larger than the model's limit of 4096"),
    (["serve", "{ckpt}", "--model", "/elsewhere"], "two models given"),
    (["serve", "{ckpt}", "-dp", "3"], "--data-parallel-size 3 does not divide the model's 4 routed experts"),
    (["serve", "{ckpt}", "--num-blocks", "3", "--block-size", "128", "--max-model-len", "1024"],
     "--num-blocks 3 holds 256 tokens per rank, fewer than --max-model-len 1024"),
    (["serve", "{ckpt}", "--metrics-require-key"], "--metrics-require-key needs an API key"),
    (["serve", "{ckpt}", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["serve", "{ckpt}", "--device", "cpu", "--kernels", "triton"], "--kernels triton needs --device cuda"),
    (["serve", "{ckpt}", "--generation-config", "/no/such/dir"], "--generation-config /no/such/dir"),
    (["serve", "{ckpt}", "--metrics-prefix", "bad-prefix"], "--metrics-prefix must be"),
    (["serve", "{ckpt}", "--tensor-parallel-size", "8", "--trust-remote-code"],
     "--tensor-parallel-size 8: tensor parallelism is not supported; serve 8 GPUs with --data-parallel-size 8"),
    (["serve", "{ckpt}", "--kv-cache-dtype", "bfloat16"],
     "--kv-cache-dtype bfloat16: the cache holds the model's own formats"),
    (["serve", "{ckpt}", "--hf-overrides", "{num_hidden_layers: 4}"], "--hf-overrides is not valid JSON"),
    (["serve", "{ckpt}", "--hf-overrides", "[4]"], "--hf-overrides must be a JSON object"),
    (["serve", "{ckpt}", "--hf-overrides", '{"num_hidden_layer": 4}'],
     "cannot override 'num_hidden_layer': config.json has no such key; did you mean 'num_hidden_layers'"),
    (["serve", "{ckpt}", "-dp", "2", "--hf-overrides", '{"n_routed_experts": 3}'],
     "--data-parallel-size 2 does not divide the model's 3 routed experts"),
    (["serve", "{ckpt}", "--hf-overrides", '{"num_hidden_layers": 8}'], "compress_ratios has 6 entries for 8 layers"),
    (["serve", "--batch-invariant", "--no-batch-invariant"], "not allowed with argument --batch-invariant"),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["generate", "--input", "in.jsonl", "--output", "out.jsonl", "--model", "/no/such/model"],
     "model directory /no/such/model does not exist"),
])
def test_configuration_errors_are_one_line_and_exit_2(argv, message, tiny_checkpoint, tmp_path, capsys,
                                                       monkeypatch):
    monkeypatch.delenv("MINI_DEEPINFER_API_KEY", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    argv = [a.replace("{ckpt}", str(tiny_checkpoint)) for a in argv]
    try:
        code = main(["--log-level", "WARNING", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_bad_model_path_in_a_real_process():
    """The installed entry point: one line on stderr, exit code 2, nothing started."""
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--model", "/no/such/model"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["mini-deepinfer serve: error: model directory /no/such/model does not exist"]
    assert result.stdout == ""


def test_bad_weights_fail_the_engine_start_with_one_line(tiny_checkpoint, tmp_path):
    """A failure only the workers can see (an unreadable weights file): one line from the frontend,
    exit code 1, no traceback from any process."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_checkpoint.iterdir():
        if item.suffix == ".json":
            (broken / item.name).write_bytes(item.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "--log-level", "WARNING", "serve", str(broken),
                             "--port", str(free_port())], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "the engine failed to start: worker 0 failed to start:" in lines[0], result.stderr
    assert "not a readable safetensors file" in lines[0] and "[frontend pid=" in lines[0]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_the_engine_starts(sig, tiny_checkpoint):
    """Ctrl-C (or SIGTERM) while the model loads: the engine is stopped, no process is left, exit code 1."""
    process = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", str(tiny_checkpoint), "--port",
                                str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline = time.monotonic() + 60
    engine = []
    while not engine and time.monotonic() < deadline:
        engine = [pid for pid in children(process.pid) if "spawn_main" in process_name(pid)]
        time.sleep(0.05)
    assert engine, "the engine core did not start"
    workers = []
    while not workers and time.monotonic() < deadline:
        workers = [pid for pid in children(engine[0]) if "spawn_main" in process_name(pid)]
        time.sleep(0.05)
    process.send_signal(sig)
    assert process.wait(timeout=60) == 1
    output = process.stdout.read()
    assert "interrupted before the server started" in output and "Traceback" not in output, output
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in engine + workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in engine + workers)
