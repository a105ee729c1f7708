"""Every message that crosses a process boundary, as typed msgspec structs.

Channels (each frame sequence starts with a one-byte ``MessageType``):

* frontend -> engine core: ``AddRequest``, ``AbortRequests``, ``UtilityRequest``
* engine core -> frontend: ``EngineOutputs`` (batched per step), ``UtilityResponse``
* engine core -> workers: ``StepPlan`` (broadcast), ``WorkerControl``
* workers -> engine core: ``StepResult`` (one per DP rank)

Structs are ``array_like`` (positional, compact) and decoded strictly into their type; nothing is
pickled. New fields go at the end with a default, so older peers still decode.
"""

from __future__ import annotations

import enum
import secrets

import msgspec

GREEDY_TEMPERATURE_EPS = 1e-5  # below this a temperature means greedy (dividing by ~0 overflows)


class MessageType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    OUTPUTS = b"\x03"
    UTILITY_RESPONSE = b"\x04"
    STEP = b"\x05"
    STEP_RESULT = b"\x06"
    CONTROL = b"\x07"
    ENGINE_DEAD = b"\x08"


class StructuredOutput(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on the generated text, compiled with xgrammar against the model's tokenizer.

    kind: ``json_schema`` (``spec`` a JSON schema text), ``json_object`` (any JSON object; ``spec``
    empty), ``regex``, ``choice`` (``spec`` a JSON list of strings) or ``grammar`` (EBNF/GBNF).
    """

    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """How one request wants its tokens chosen and when it stops (OpenAI / vLLM semantics)."""

    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 => disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None  # None => the engine draws one (random_seed) when the request arrives
    logprobs: int | None = None  # top-N logprobs per sampled token (0 => the sampled token's only)
    prompt_logprobs: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured: StructuredOutput | None = None  # constrained decoding (see StructuredOutput)

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and n < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {n}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0 <= self.min_tokens:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def random_seed() -> int:
    """The seed of a request that gave none (63 bits: fits an int64 message field)."""
    return secrets.randbits(63)


# ----------------------------------------------------------------------------- frontend <-> core
class AddRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0


class AbortRequests(msgspec.Struct, array_like=True):
    request_ids: list[str]


class TokenLogprob(msgspec.Struct, array_like=True):
    """A sampled (or prompt) token's logprob and the top-N alternatives at that position."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request since its previous output (a delta)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_token_id: int | None = None  # the token id that stopped it (EOS or stop_token_ids)
    num_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # position 0 has none: starts at token 1
    first_scheduled_time: float = 0.0  # when its prefill was first scheduled (queue time)
    error: str = ""  # the engine rejected the request (finish_reason "abort"): why


# upper bounds of the tokens-per-step histogram (vLLM's vllm:iteration_tokens_total buckets); a
# step above the last one counts in the +Inf bucket
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class SchedulerStats(msgspec.Struct, array_like=True):
    """The engine's gauges (summed over DP ranks) and cumulative counters since it started, then
    the per-rank values they sum."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    state_slots_used: int = 0
    state_slots_total: int = 0
    preemptions: int = 0
    # steps by tokens scheduled (all ranks): count per ITERATION_TOKEN_BUCKETS bound, then the
    # +Inf bucket (not cumulative), and the tokens of all steps
    step_token_counts: list[int] = []
    step_tokens_sum: int = 0
    # the same per DP rank (index = rank), for the per-rank metrics. Waiting has no split: the queue
    # is shared and a sequence gets its rank only when it is admitted.
    rank_running: list[int] = []
    rank_kv_blocks_used: list[int] = []
    rank_kv_blocks_total: list[int] = []
    rank_state_slots_used: list[int] = []
    rank_state_slots_total: list[int] = []
    rank_preemptions: list[int] = []  # cumulative
    rank_tokens_scheduled: list[int] = []  # cumulative: prefill and decode tokens planned for the rank
    # expert load (workers/expert_load.py): the busiest rank's routed (token, expert) pairs over the
    # mean, summed over MoE layers, in the last window the workers reported (1.0 before any), each
    # rank's pairs computed since startup, and the placements changed while serving
    expert_load_imbalance: float = 1.0
    rank_expert_pairs: list[int] = []
    expert_rebalances: int = 0


class EngineSummary(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the engine reports once it is ready, for the startup summary."""

    devices: list[str]  # one per DP rank, e.g. "cuda:0 NVIDIA H200 (139.8 GiB)" or "cpu (1 thread)"
    weight_formats: str  # e.g. "fp8 e4m3 dense + fp4 e2m1 experts (UE8M0 block scales)"
    kv_cache_dtype: str
    kernels: str
    batch_invariant: bool
    zos: bool
    cuda_graphs: str  # what decode steps replay, or "none (eager: why)"
    dp_size: int
    num_routed_experts: int
    block_size: int
    kv_blocks_per_rank: int  # usable blocks (the padding block not counted)
    state_slots_per_rank: int
    max_num_seqs: int  # per rank
    max_model_len: int  # the effective limit (the model's, --max-model-len, or what the KV cache holds)
    model_max_len: int  # the model's max_position_embeddings
    kv_cache_bytes_per_rank: int = 0
    state_bytes_per_rank: int = 0


class EngineOutputs(msgspec.Struct, array_like=True):
    outputs: list[RequestOutput]
    stats: SchedulerStats
    timestamp: float = 0.0


class UtilityRequest(msgspec.Struct, array_like=True):
    call_id: int
    method: str  # "ping" | "stats"


class UtilityResponse(msgspec.Struct, array_like=True):
    call_id: int
    result: str = ""  # "pong", "ready", or (with ENGINE_DEAD) why the engine died
    stats: SchedulerStats | None = None
    # with "ready": what the frontend needs to validate requests
    max_model_len: int = 0
    vocab_size: int = 0
    eos_token_id: int | None = None
    summary: EngineSummary | None = None  # with "ready": for the startup summary


# ----------------------------------------------------------------------------- core <-> workers
class SequenceStep(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's work in a step: positions ``start .. start + len(token_ids) - 1``.

    A decode input whose token is still on the device (zero-overhead scheduling) has
    ``token_ids == [-1]`` and ``prev_row`` = its row in this rank's previous step's samples.
    """

    seq_id: int
    epoch: int
    start: int
    token_ids: list[int]
    slot: int
    block_table: list[int]
    sample: bool  # does the chunk's last position produce the next token?
    seed: int = 0
    params: SamplingParams | None = None  # when sample or prompt logprobs are wanted
    prev_row: int = -1
    previous_start: int = -1  # start of this sequence's previous forward (official hand-off only)
    num_prompt_tokens: int = 0  # tokens at positions >= this are outputs
    history_token_ids: list[int] = []  # all known tokens (prompt + outputs), only when penalties are on
    prompt_logprob_targets: list[int] = []  # token after each of the first rows: prompt logprobs wanted
    suppress_token_ids: list[int] = []  # never sample these now (stop tokens before min_tokens)
    # constrained decoding: the output tokens known so far, on the chunk that samples a (re)admitted
    # sequence's next token, so that the worker can (re)build its grammar matcher from them
    structured_output_ids: list[int] = []


class RankBatch(msgspec.Struct, array_like=True):
    sequences: list[SequenceStep]


class StepPlan(msgspec.Struct, array_like=True):
    step_id: int
    is_prefill: bool  # the step has prompt chunks (with mixed steps, decode rows may run beside them)
    ranks: list[RankBatch]  # one per DP rank; a rank with no sequences runs a placeholder step
    released_seq_ids: list[int] = []  # constrained sequences finished since the last plan: drop their matchers


class SampledToken(msgspec.Struct, array_like=True, omit_defaults=True):
    seq_id: int
    epoch: int
    token_id: int
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class ExpertLoadReport(msgspec.Struct, array_like=True):
    """A worker's expert-load counters since it started (cumulative, so a lost report loses nothing),
    sent with the results of every few steps (workers/expert_load.py). Counts are int64
    little-endian, one per (MoE layer, expert) or (MoE layer, slot), of this rank's tokens."""

    num_layers: int
    num_experts: int
    num_slots: int  # experts + redundant copies per layer, rank r holding slots r * S .. (r + 1) * S - 1
    routed: bytes  # [num_layers, num_experts]: tokens routed to each logical expert
    slots: bytes  # [num_layers, num_slots]: tokens sent to each slot (the rank holding it computes them)
    rebalances: int = 0  # placements changed while serving


class StepResult(msgspec.Struct, array_like=True):
    step_id: int
    rank: int
    tokens: list[SampledToken]
    error: str = ""
    expert_load: ExpertLoadReport | None = None


class WorkerControl(msgspec.Struct, array_like=True):
    # "shutdown" | "ping" | "pong" | "ready" | "grammar" | "collect" (send the results of the step
    # held: no later plan is coming to push them out; workers.step_pipeline); multi-node: "joined"
    # (a worker's links are open; its host name in device_name) and "died" (a headless node reports
    # a dead worker; why in error)
    command: str
    rank: int = -1
    nonce: int = 0
    # with "ready": the worker's cache geometry and model facts
    num_blocks: int = 0
    num_slots: int = 0
    max_model_len: int = 0
    vocab_size: int = 0
    eos_token_id: int | None = None
    error: str = ""
    # with "grammar": a structured-output spec to compile ahead of the steps that will need it
    grammar: StructuredOutput | None = None
    # with "ready", for the startup summary: the worker's device and the dtype of its caches
    device_name: str = ""
    kv_cache_dtype: str = ""


# ----------------------------------------------------------------------------- encoding helpers
_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview, kind: type):
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return decoder.decode(data)
