"""Frontend pieces without a server: incremental detokenizer, stop strings, fake engine, logprobs."""

from __future__ import annotations

import asyncio
import random


from engine_core.protocol import RequestOutput, SamplingParams, TokenLogprob
from frontend.fake_engine import fake_engine_for
from frontend.logprobs import LogprobFormatter
from frontend.output_stream import OutputStream

TEXT = "Hello wörld, 你好! The quick brown 🦊 fox jumps over the lazy dog. Ünïcödé ends here."


def _feed(stream: OutputStream, ids: list[int], chunk_sizes: list[int], finish: str = "length",
          stop_token_id: int | None = None) -> list[str]:
    pieces, i = [], 0
    while i < len(ids):
        k = chunk_sizes[len(pieces) % len(chunk_sizes)]
        last = i + k >= len(ids)
        delta = stream.process(RequestOutput("r", ids[i:i + k], finish if last else None,
                                             stop_token_id if last else None))
        pieces.append(delta.text)
        i += k
        if delta.finish_reason is not None:
            break
    return pieces


def test_incremental_detokenizer_matches_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(50):
        context = tokenizer.encode("Some prompt text", add_special_tokens=True)
        detok = tokenizer.detokenizer(context)
        out, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 4)
            piece = detok.add(ids[i:i + k])
            assert "\ufffd" not in piece  # never half a character
            out.append(piece)
            i += k
        out.append(detok.flush())
        assert "".join(out) == TEXT


def test_stop_string_across_token_boundaries_is_held_back_and_cut(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces_of = [tokenizer.decode([t]) for t in ids]
    # a stop string made of the end of one token and the start of the next
    k = next(i for i in range(3, len(ids) - 1)
             if len(pieces_of[i]) >= 2 and len(pieces_of[i + 1]) >= 2 and "\ufffd" not in pieces_of[i] + pieces_of[i + 1])
    stop = pieces_of[k][-2:] + pieces_of[k + 1][:2]
    expected = TEXT[:TEXT.index(stop)]
    for sizes in ([1], [2, 3], [len(ids)]):
        stream = OutputStream(tokenizer, [], [stop, "never-there"], accumulate=True)
        pieces = _feed(stream, ids, sizes)
        assert "".join(pieces) == expected == stream.text
        assert stream.finish_reason == "stop" and stream.stop_reason == stop
        # nothing streamed was ever part of the stop string
        assert all(stop not in "".join(pieces[:j + 1]) for j in range(len(pieces)))


def test_stop_string_included_when_asked(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stream = OutputStream(tokenizer, [], ["lazy"], include_stop_str=True)
    _feed(stream, ids, [1])
    assert stream.text == TEXT[:TEXT.index("lazy") + 4]


def test_stop_token_text_left_out_but_counted(tokenizer):
    ids = tokenizer.encode("a few words", add_special_tokens=False)
    stop_token = tokenizer.encode(" stop", add_special_tokens=False)[-1]
    stream = OutputStream(tokenizer, [], eos_token_id=tokenizer.eos_token_id)
    _feed(stream, ids + [stop_token], [2], finish="stop", stop_token_id=stop_token)
    assert stream.text == "a few words"
    assert stream.token_ids == ids + [stop_token] and stream.stop_reason == stop_token


def test_without_stop_strings_nothing_is_held_back(tokenizer):
    ids = tokenizer.encode("plain ascii text", add_special_tokens=False)
    stream = OutputStream(tokenizer, [], None)
    first = stream.process(RequestOutput("r", ids[:2], None))
    assert first.text == tokenizer.decode(ids[:2])


def test_completion_logprobs_offsets_skip_special_tokens(tokenizer):
    prompt = tokenizer.encode("Hi there", add_special_tokens=True)
    prompt_lps = [TokenLogprob(t, -1.0, [t], [-1.0]) for t in prompt[1:]]
    out = [TokenLogprob(prompt[1], -0.5, [prompt[2]], [-0.1])]
    logprobs, end = LogprobFormatter(tokenizer).completion(out, 0, prompt, prompt_lps)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[:2] == [0, 0]  # bos is not part of the text
    assert logprobs.top_logprobs[-1][logprobs.tokens[-1]] == -0.5  # the chosen token is always listed
    assert end == len("Hi there") + len(logprobs.tokens[-1])


def _run_fake(coro_factory):
    async def main():
        return await coro_factory()

    return asyncio.run(main())


def test_fake_engine_is_deterministic_and_honours_limits(tokenizer):
    async def scenario():
        engine = fake_engine_for(tokenizer)
        await engine.start()

        async def tokens(request_id, params, prompt=(10, 11, 12)):
            out = []
            async for o in engine.generate(request_id, list(prompt), params):
                out.extend(o.new_token_ids)
                last = o
            return out, last

        a, _ = await tokens("a", SamplingParams(seed=3, max_tokens=20))
        b, last = await tokens("b", SamplingParams(seed=3, max_tokens=20, logprobs=2))
        c, _ = await tokens("c", SamplingParams(seed=4, max_tokens=20))
        assert a == b and a != c and len(a) == 20 and last.finish_reason == "length"
        stop_at = a[5]
        d, last = await tokens("d", SamplingParams(seed=3, max_tokens=20, stop_token_ids=(stop_at,)))
        assert d == a[:a.index(stop_at) + 1] and last.finish_reason == "stop" and last.stop_token_id == stop_at
        e, _ = await tokens("e", SamplingParams(seed=3, max_tokens=20, min_tokens=12, stop_token_ids=(stop_at,)))
        assert len(e) >= 12
        g1, _ = await tokens("g1", SamplingParams(temperature=0, max_tokens=8))
        g2, _ = await tokens("g2", SamplingParams(temperature=0, max_tokens=8))
        assert g1 == g2  # greedy: a function of the prompt only
        eos_engine = fake_engine_for(tokenizer, eos_probability=1.0)
        await eos_engine.start()
        outs = [o async for o in eos_engine.generate("x", [5, 6], SamplingParams(max_tokens=9, min_tokens=3))]
        ids = [t for o in outs for t in o.new_token_ids]
        assert len(ids) == 3 and ids[-1] == tokenizer.eos_token_id and outs[-1].finish_reason == "stop"
        outs = [o async for o in eos_engine.generate("y", [5, 6], SamplingParams(max_tokens=9, ignore_eos=True))]
        assert sum(len(o.new_token_ids) for o in outs) == 9
        # logprobs: the sampled token is in its top list; prompt logprobs cover positions 1..P-1
        outs = [o async for o in engine.generate("lp", [7, 8, 9, 10], SamplingParams(max_tokens=3, logprobs=4,
                                                                                     prompt_logprobs=2))]
        lps = [lp for o in outs for lp in o.logprobs]
        assert all(lp.token_id in lp.top_ids and len(lp.top_ids) == 4 for lp in lps)
        assert [p.token_id for p in outs[0].prompt_logprobs] == [8, 9, 10]
        # abort: a consumer that stops early aborts its request, stats return to zero
        gen = engine.generate("long", [1, 2, 3], SamplingParams(max_tokens=1000))
        await gen.__anext__()
        assert engine.stats().running == 1 and engine.stats().kv_blocks_used == 1
        await gen.aclose()
        assert engine.aborted_ids == ["long"] and engine.stats().running == 0
        await engine.shutdown()
        await eos_engine.shutdown()

    _run_fake(scenario)
