"""One request's generation state as the scheduler sees it.

Token accounting (the invariants the scheduler keeps):

* ``num_tokens``: prompt + output tokens known on the CPU.
* ``num_inflight_tokens``: tokens being sampled by a step that was sent to the device but whose
  result has not reached the CPU yet (0 or 1 with zero-overhead scheduling).
* ``num_cached_tokens``: positions already submitted for writing into the caches (the steps that
  wrote them may still be in flight).

A sequence is being prefilled until the chunk that samples its first new token is scheduled
(``prefill_done``); it may take a decode step only when
``num_cached_tokens == num_tokens + num_inflight_tokens - 1`` (its newest token, known
or in flight, is the one not yet written). Preemption frees its blocks and slot, bumps ``epoch``
(results of older epochs are dropped) and restarts it from position 0 with the tokens it has.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .protocol import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_token_id: int | None = None
    dp_rank: int = -1
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_inflight_tokens: int = 0
    epoch: int = 0
    previous_start: int = -1  # start position of the last forward this sequence took part in
    prefill_done: bool = False  # the chunk ending at its last known token has been scheduled
    first_scheduled_time: float = 0.0
    prompt_logprobs: list[TokenLogprob] | None = None
    # output bookkeeping: how many output tokens were already reported to the client
    num_reported: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def prompt_logprobs_done(self) -> bool:
        """Every prompt position with a next prompt token has its logprob."""
        return len(self.prompt_logprobs or []) >= self.num_prompt_tokens - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_outputs_expected(self) -> int:
        """Outputs known plus those in flight."""
        return len(self.output_token_ids) + self.num_inflight_tokens

    @property
    def is_prefilling(self) -> bool:
        return not self.prefill_done

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, position: int) -> int:
        if position < len(self.prompt_token_ids):
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - len(self.prompt_token_ids)]

    def tokens(self, start: int, end: int) -> list[int]:
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_token_ids)[start:end]
