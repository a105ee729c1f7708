"""The offline API as vLLM users write it: ``LLM.generate`` / ``LLM.chat`` with ``SamplingParams``
(n, stop strings, seeds, logprobs, prompt logprobs, structured output), vLLM-shaped outputs, and
the model's generation_config.json as the default sampling parameters."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine_core.protocol import SamplingParams as EngineSamplingParams
from frontend.llm import LLM, Logprob, PromptError, RequestOutput, SamplingParams

ENGINE = dict(device="cpu", block_size=16, num_blocks=64, max_num_seqs=8, max_model_len=128)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), **ENGINE)


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert not llm.engine.has_work and stats.running == stats.waiting == 0
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_the_vllm_example_runs():
    llm = LLM()
    outs = llm.generate(["Hello", "The capital of"], SamplingParams(n=2, stop=["."], max_tokens=8, seed=1))
    assert isinstance(outs[0].outputs[1].text, str)
    assert [o.prompt for o in outs] == ["Hello", "The capital of"]
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished and out.prompt_token_ids
        assert [c.index for c in out.outputs] == [0, 1]
        for choice in out.outputs:
            assert len(choice.token_ids) <= 8 and "." not in choice.text
            assert choice.finish_reason in ("stop", "length") and choice.finished()
            assert choice.stop_reason in (None, ".")  # "." when the stop string ended it (None: eos, length)
            assert choice.stop_reason is None or choice.finish_reason == "stop"
    assert outs[0].outputs[0].token_ids != outs[0].outputs[1].token_ids  # seed 1 and seed 2
    assert_idle(llm)


def test_stop_strings_cut_the_text_and_free_the_sequence(llm):
    free = llm.generate("Once upon a time", SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0].outputs[0]
    stop = free.text[4:7]
    cut = llm.generate("Once upon a time", SamplingParams(max_tokens=20, temperature=0, stop=[stop, "zzzz"]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == free.text[:free.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert free.token_ids[:len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < len(free.token_ids)
    kept = llm.generate("Once upon a time", SamplingParams(max_tokens=20, temperature=0, stop=stop,
                                                           include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == free.text[:free.text.index(stop) + len(stop)]
    assert_idle(llm)


def test_choice_i_samples_with_seed_plus_i(llm):
    both = llm.generate([[5, 6, 7, 8]], SamplingParams(n=3, max_tokens=6, seed=11, temperature=1.0), use_tqdm=False)[0]
    for i in range(3):
        alone = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, seed=11 + i, temperature=1.0),
                             use_tqdm=False)[0].outputs[0]
        assert both.outputs[i].token_ids == alone.token_ids and both.outputs[i].text == alone.text


def test_logprobs_and_prompt_logprobs_in_vllm_shape(llm):
    prompt = [11, 12, 13, 14, 15]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    choice = out.outputs[0]
    assert len(choice.logprobs) == len(choice.token_ids)
    for token_id, position in zip(choice.token_ids, choice.logprobs):
        assert token_id in position and 2 <= len(position) <= 3
        assert all(isinstance(lp, Logprob) and lp.logprob <= 0 and lp.decoded_token is not None
                   for lp in position.values())
        assert position[token_id].rank == 1  # greedy: the chosen token is the most likely one
        assert sorted(lp.rank for t, lp in position.items() if t != token_id) == list(range(2, len(position) + 1))
    assert choice.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(choice.token_ids,
                                                                                       choice.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for token_id, position in zip(prompt[1:], out.prompt_logprobs[1:]):
        assert token_id in position and 3 <= len(position) <= 4
        best = max(lp.logprob for lp in position.values())
        assert {lp.rank for lp in position.values() if lp.logprob == best} >= {1}
    # the same numbers as the engine's own entries (the old flat access still works)
    legacy = llm.generate([prompt], EngineSamplingParams(max_tokens=4, temperature=0, logprobs=2), use_tqdm=False)[0]
    assert legacy.token_ids == choice.token_ids
    assert [e.logprob for e in legacy.logprobs] == [p[t].logprob for t, p in zip(choice.token_ids, choice.logprobs)]
    no_logprobs = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert no_logprobs.outputs[0].logprobs is None and no_logprobs.outputs[0].cumulative_logprob is None
    assert no_logprobs.prompt_logprobs is None


def test_chat_renders_as_the_server_does(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert out.prompt == llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    same = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert out.outputs[0].text == same.outputs[0].text
    # several conversations; continuing the final (assistant) message leaves it open (no eos)
    prefill = messages + [{"role": "assistant", "content": "Once upon"}]
    outs = llm.chat([messages, prefill], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)
    assert len(outs) == 2 and outs[1].prompt.endswith("Once upon")
    assert llm.tokenizer.eos_token_id not in outs[1].prompt_token_ids


@pytest.mark.parametrize("kwargs,message", [
    (dict(messages=[{"role": "robot", "content": "x"}]), "unknown role"),
    (dict(messages=[{"role": "user"}, {"content": "x"}]), "role"),
    (dict(messages=[{"role": "user", "content": "x"}], continue_final_message=True), "add_generation_prompt"),
    (dict(messages=[{"role": "user", "content": "x"}], chat_template_kwargs={"messages": []}), "messages"),
])
def test_bad_conversations_are_errors_naming_the_problem(llm, kwargs, message):
    with pytest.raises(PromptError, match=message):
        llm.chat(sampling_params=SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)


def test_structured_outputs(llm):
    pytest.importorskip("xgrammar")
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=2, structured_outputs={"choice": ["yes", "no"]})
    outs = llm.generate(["Is it?"] * 3, params, use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no") and o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(n=0), "n must be"), (dict(top_p=0), "top_p"), (dict(temperature=-1.0), "temperature"),
    (dict(stop=[3]), "stop must be"), (dict(logprobs=21), "logprobs"), (dict(best_of=2), "best_of"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(structured_outputs={"json": 5}), "structured_outputs"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
])
def test_bad_sampling_params_are_errors_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompts_in_every_form(llm):
    text = llm.tokenizer.encode("Hello")
    forms = llm.generate(["Hello", {"prompt": "Hello"}, {"prompt_token_ids": text}, text],
                         SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in forms}) == 1
    with pytest.raises(PromptError, match="prompt 1: token id"):
        llm.generate([[5], [10**6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_idle(llm)


# ----------------------------------------------------------------------------- generation_config.json
@pytest.fixture()
def checkpoint_with_defaults(tiny_checkpoint, tmp_path):
    """The tiny checkpoint with a generation_config.json recommending sampling settings."""
    for entry in tiny_checkpoint.iterdir():
        if entry.name != "generation_config.json":
            os.symlink(entry, tmp_path / entry.name)
    config = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    config.update(temperature=0.0, top_k=5, max_new_tokens=3, do_sample=False)
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_generation_config_supplies_the_defaults(checkpoint_with_defaults, llm):
    llm_defaults = LLM(str(checkpoint_with_defaults), **ENGINE)
    defaults = llm_defaults.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens, defaults.top_p) == (0.0, 5, 3, 1.0)
    out = llm_defaults.generate("Once upon a time", use_tqdm=False)[0].outputs[0]
    greedy = llm.generate("Once upon a time", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert out.token_ids == greedy.outputs[0].token_ids
    # explicit parameters are used as given (vLLM: the defaults apply without sampling parameters)
    given = llm_defaults.generate("Once upon a time", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert len(given[0].outputs[0].token_ids) == 5
    neutral = LLM(str(checkpoint_with_defaults), generation_config="vllm", **ENGINE).get_default_sampling_params()
    assert (neutral.temperature, neutral.top_k, neutral.max_tokens) == (1.0, 0, 16)


@pytest.mark.parametrize("content,message", [("{not json", "not readable JSON"), ('{"temperature": "hot"}', "temperature"),
                                              ('{"top_p": 1.5}', "top_p"), ('{"max_new_tokens": 2.5}', "max_new_tokens")])
def test_a_bad_generation_config_is_an_error_naming_it(tmp_path, content, message):
    from frontend.generation_config import load_sampling_defaults

    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load_sampling_defaults(tmp_path)
    assert "generation_config.json" in str(info.value)
    assert load_sampling_defaults(tmp_path, "vllm") == {}


def test_a_max_model_len_above_the_models_limit_is_an_error():
    """The CLI refuses it before starting; the offline API must not clamp it silently either."""
    from engine_core.config import EngineConfigError

    with pytest.raises(EngineConfigError, match="than the model's limit of 4096"):
        LLM(max_model_len=10**9)


def test_vllm_recipe_arguments_are_accepted_or_refused_by_name():
    """``LLM(..., trust_remote_code=True, enable_expert_parallel=True)`` as vLLM's examples write it is
    accepted (checked past the recipe arguments: the next error is the bad max_model_len);
    ``tensor_parallel_size`` other than 1 is refused, naming the flag to use, before anything starts."""
    from engine_core.config import EngineConfigError

    with pytest.raises(EngineConfigError, match="than the model's limit"):
        LLM(trust_remote_code=True, enable_expert_parallel=True, tensor_parallel_size=1, kv_cache_dtype="fp8",
            max_model_len=10**9)
    with pytest.raises(EngineConfigError, match="tensor parallelism is not supported; serve 2 GPUs with "
                                                "--data-parallel-size 2"):
        LLM(tensor_parallel_size=2)


def test_dummy_weights_at_a_smaller_size_by_hf_overrides(tmp_path):
    """vLLM's way to try a model without its weights at a smaller size: a directory holding only
    config.json and a tokenizer, ``load_format="dummy"``, fewer layers and experts by ``hf_overrides``
    (``--hf-overrides`` on the command line); the weights made follow the overridden config."""
    from model.checkpoint_maker import make_checkpoint

    directory = make_checkpoint(tmp_path / "tiny", preset="tiny", config_only=True)
    assert not list(directory.glob("*.safetensors"))
    overrides = {"num_hidden_layers": 4, "n_routed_experts": 2, "num_experts_per_tok": 1}
    with LLM(str(directory), load_format="dummy", hf_overrides=overrides, **ENGINE) as llm:
        model = llm.engine.executor.runner.model
        assert (model.cfg.num_layers, model.cfg.num_routed_experts, len(model.blocks)) == (4, 2, 4)
        assert model.blocks[0].moe.router.weight.shape[0] == 2
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert_idle(llm)


def test_a_model_cut_short_hashes_only_the_engram_layers_it_has(tmp_path):
    """With fewer layers, an Engram layer past the last one is gone: the n-gram hasher keeps the hashes of
    the layers left (their primes, which were picked among all the config's layers, unchanged)."""
    from model.checkpoint_maker import make_checkpoint
    from model.loader import load_model

    directory = make_checkpoint(tmp_path / "tiny", preset="tiny", config_only=True)
    full = load_model(directory, load_format="dummy")
    cut = load_model(directory, load_format="dummy",
                     hf_overrides={"num_hidden_layers": 1, "candidate_source_layer_id": -1})
    assert full.hasher.layer_ids == (0, 1) and cut.hasher.layer_ids == (0,)
    for name in ("multipliers", "primes", "offsets"):
        assert torch.equal(getattr(cut.hasher, name), getattr(full.hasher, name)[:1]), name
    with LLM(str(directory), load_format="dummy", hf_overrides={"num_hidden_layers": 1, "candidate_source_layer_id": -1},
             **ENGINE) as llm:
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
