"""One choice's output: incremental detokenization and stop strings.

``OutputStream.process`` turns each engine delta (new token ids) into the text a client may be
sent now. Stop strings are matched on the detokenized text, also across token boundaries: the
last ``len(longest stop) - 1`` characters are held back until the following text shows they are
not the start of a stop string, so no streamed chunk ever has to be taken back. When a stop
string is found the text is cut before it (or after it, with ``include_stop_str_in_output``) and
the choice finishes with reason "stop"; the caller then aborts the engine request.

A stop *token* (eos or one of ``stop_token_ids``) arrives as the last new token id; it is counted
as a completion token but its text is not part of the output (as in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.protocol import RequestOutput, TokenLogprob

from .tokenizer import Tokenizer


@dataclass(slots=True)
class StreamDelta:
    text: str  # text that may be sent now
    token_ids: list[int]  # new token ids (all of them, the stop token included)
    logprobs: list[TokenLogprob] | None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprob] | None  # once, when asked for (positions 1..P-1)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the choice


class OutputStream:
    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: list[str] | None = None,
                 *, include_stop_str: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0,
                 eos_token_id: int | None = None, accumulate: bool = True):
        self.detokenizer = tokenizer.detokenizer(prompt_ids, skip_special_tokens) if tokenizer is not None else None
        self.stop = [s for s in (stop or []) if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.include_stop_str = include_stop_str
        self.min_tokens = min_tokens
        self.eos_token_id = eos_token_id
        self.accumulate = accumulate  # keep the whole text/logprobs (non-streaming responses)
        self.num_prompt_tokens = len(prompt_ids)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._pending = ""  # held-back text: possibly the start of a stop string
        self._parts: list[str] = []  # text already released (kept when accumulating)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All text released so far (the whole output once finished)."""
        return "".join(self._parts)

    def process(self, output: RequestOutput) -> StreamDelta:
        new_ids = output.new_token_ids
        self.token_ids.extend(new_ids)
        finish, stop_reason = output.finish_reason, None
        text_ids = new_ids
        if finish == "stop" and output.stop_token_id is not None and new_ids and new_ids[-1] == output.stop_token_id:
            if output.stop_token_id != self.eos_token_id:
                stop_reason = output.stop_token_id
            if not self.include_stop_str:
                text_ids = new_ids[:-1]
        new_text = ""
        if self.detokenizer is not None:
            if text_ids:
                new_text = self.detokenizer.add(text_ids)
            if finish is not None:
                new_text += self.detokenizer.flush()
        buffer = self._pending + new_text
        if self.stop and new_text and len(self.token_ids) >= self.min_tokens:
            cut, hit = self._find_stop(buffer)
            if hit is not None:
                buffer, finish, stop_reason = buffer[:cut], "stop", hit
        if finish is not None:
            released, self._pending = buffer, ""
        else:
            keep = min(self.hold_back, len(buffer))
            released, self._pending = buffer[:len(buffer) - keep], buffer[len(buffer) - keep:]
        if self.accumulate:
            if released:
                self._parts.append(released)
            if output.logprobs:
                self.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if finish is not None:
            self.finish_reason, self.stop_reason = finish, stop_reason
        return StreamDelta(released, new_ids, output.logprobs, output.prompt_logprobs, finish, stop_reason)

    def _find_stop(self, buffer: str) -> tuple[int, str | None]:
        """The earliest stop string in ``buffer``: (where the kept text ends, the stop string)."""
        best_at, best = len(buffer) + 1, None
        for stop in self.stop:
            at = buffer.find(stop)
            if at != -1 and at < best_at:
                best_at, best = at, stop
        if best is None:
            return len(buffer), None
        return (best_at + len(best) if self.include_stop_str else best_at), best
