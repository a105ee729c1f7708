"""Engine configuration: one frozen dataclass that is both the engine's settings and the
declaration of its command-line flags (``cli_options.flag`` in each field's metadata), resolved
and checked once (``engine_config_from_args``) before any process starts.

Flag names follow vLLM where the meaning is the same (``--data-parallel-size/-dp``, ``--seed``,
``--enforce-eager``, ``--max-model-len``, ...). Checks that need the model directory
(``check_engine_config``: the files are there, ``--max-model-len`` within the model's limit, the
device exists) raise ``EngineConfigError`` with one line for the user.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cli_options import add_dataclass_flags, flag, values_from_args
from .vllm_recipe_flags import add_vllm_recipe_flags, check_vllm_recipe_flags

if TYPE_CHECKING:
    from model.config import V41Config


class EngineConfigError(ValueError):
    """A configuration that cannot run (a bad model path, a limit exceeded, incompatible flags)."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(metadata=flag(
        "checkpoint directory (official DeepSeek-V4.1 layout: config.json, *.safetensors, tokenizer)",
        default_help="the embedded tiny model"))
    device: str = field(default="cpu", metadata=flag(
        "where the workers run", choices=("cpu", "cuda"), default_help="cuda if available, else cpu"))
    dp_size: int = field(default=1, metadata=flag(
        "data-parallel ranks: one worker process per GPU or CPU rank; the routed experts are sharded over them",
        names=("--data-parallel-size", "-dp", "--dp"), metavar="N"))
    nnodes: int = field(default=1, metadata=flag(
        "nodes the --dp ranks are spread over, dp / nnodes on each: node 0 runs the frontend and the engine "
        "core, every other node `serve --headless` (README, Multi-node)", metavar="N"))
    node_rank: int = field(default=0, metadata=flag("this node's index, 0 .. --nnodes - 1", metavar="R"))
    headless: bool = field(default=False, metadata=flag(
        "run only this node's workers (a node with --node-rank > 0): no frontend, no engine core"))
    master_addr: str = field(default="127.0.0.1", metadata=flag(
        "node 0's address as every node reaches it; the engine core listens there (with --nnodes > 1)",
        names=("--master-addr", "--data-parallel-address"), metavar="HOST"))
    master_port: int = field(default=29500, metadata=flag(
        "first of node 0's three ports: P torch.distributed rendezvous, P+1 step plans, P+2 results",
        names=("--master-port", "--data-parallel-rpc-port"), metavar="P"))
    cluster_key_file: str | None = field(default=None, metadata=flag(
        "file holding a secret of >= 32 characters that every node shares; the CURVE keys of the links "
        "between nodes are derived from it", metavar="FILE", default_help="required with --nnodes > 1"))
    join_timeout: float = field(default=300.0, metadata=flag(
        "seconds the engine core waits for every rank of every node to connect (with --nnodes > 1)"))
    max_num_seqs: int = field(default=64, metadata=flag("running sequences per DP rank"))
    max_num_batched_tokens: int = field(default=512, metadata=flag("prefill tokens per step per DP rank"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "longest sequence (prompt + output) in tokens; an error if above the model's limit. The rotary tables "
        "cover it (and a prefill batch) rather than the model's whole limit (V4.1's 1M positions: 512 MiB per GPU)",
        default_help="the model's max_position_embeddings, or less if the KV cache cannot hold that"))
    block_size: int = field(default=128, metadata=flag("source tokens per paged KV block"))
    num_blocks: int | None = field(default=None, metadata=flag(
        "KV blocks per DP rank (overrides the memory budget)", default_help="from the memory budget"))
    num_state_slots: int | None = field(default=None, metadata=flag(
        "per-sequence state slots per DP rank (sliding-window rings, compressor tails)",
        default_help="--max-num-seqs"))
    gpu_memory_utilization: float = field(default=0.9, metadata=flag(
        "fraction of GPU memory a worker may use, weights and caches included"))
    cpu_kv_cache_gb: float = field(default=1.0, metadata=flag("memory budget of the caches of a CPU worker, in GiB"))
    cpu_threads: int = field(default=1, metadata=flag(
        "intra-op threads of a CPU worker (small models run fastest on one)"))
    zos: bool = field(default=True, metadata=flag(
        "zero-overhead scheduling: plan step N+1 while step N runs", negative="--no-zos"))
    mixed_steps: bool = field(default=False, metadata=flag(
        "decode rows and prompt chunks in one step (decode first, prompts in the budget left); off: a step "
        "runs prompt chunks or decode rows, prompts first (faster on GPU while steps with prompt chunks run "
        "eagerly: docs/benchmarks-log.md)", negative="--no-mixed-steps"))
    batch_invariant: bool | None = field(default=None, metadata=flag(
        "every row's result independent of the batch it is in", negative="--no-batch-invariant",
        default_help="on for cpu, off for cuda"))
    official_index_handoff: bool = field(default=False, metadata=flag(
        "reproduce the reference's index-key hand-off on decode steps (see model/transformer.py)"))
    max_queued_requests: int = field(default=1024, metadata=flag(
        "sequences that may wait beyond the running ones; more get 503 with Retry-After"))
    max_seqs_per_request: int = field(default=256, metadata=flag(
        "largest number of sequences (prompts x n) one request may ask for; more get 400"))
    step_timeout: float = field(default=120.0, metadata=flag(
        "seconds a step may take before its rank is declared stuck and the server exits"))
    kernels: str | None = field(default=None, metadata=flag(
        "kernel backend of the FP8/FP4 products", choices=("reference", "triton"),
        default_help="triton on cuda, reference on cpu"))
    enable_pdl: bool = field(default=False, metadata=flag(
        "programmatic dependent launch: the Triton kernels of the decode-sized products start while the "
        "kernel before them finishes (Hopper or later; needs --kernels triton; not the default: a layer's "
        "FP8 products and the engine's decode steps measured no faster with it on one H100, docs/benchmarks-log.md)"))
    load_format: str = field(default="auto", metadata=flag(
        "auto: the checkpoint's safetensors files; dummy: random weights in their storage formats made on "
        "the device, the routers' biases zero so that tokens spread over the experts as in a load-balanced "
        "model (the directory needs only config.json and a tokenizer: make-checkpoint --config-only)",
        choices=("auto", "dummy")))
    hf_overrides: str | None = field(default=None, metadata=flag(
        "a JSON object of values that replace config.json's (vLLM's flag; a key of text_config or of the top "
        "level, a dict merged key by key), e.g. '{\"num_hidden_layers\": 8, \"n_routed_experts\": 64}' with "
        "--load-format dummy: a real-width model with fewer layers or experts; a key config.json lacks is an error",
        metavar="JSON"))
    seed: int | None = field(default=None, metadata=flag(
        "seed of the generator that draws the sampling seed of each request that gives none: the same "
        "requests in the same order then give the same outputs", default_help="random"))
    generation_config: str = field(default="auto", metadata=flag(
        "default sampling parameters of requests that leave them out: auto (the model directory's "
        "generation_config.json), vllm (none: neutral defaults), or a directory holding a generation_config.json"))
    expert_capacity_factor: float | None = field(default=None, metadata=flag(
        "token rows one rank may send another per MoE layer, as a multiple of the mean under uniform "
        "routing; rows beyond it take a second, slower exchange (counted, never dropped)",
        default_help="the worst case: no second exchange ever"))
    num_redundant_experts: int = field(default=0, metadata=flag(
        "extra copies of routed experts per MoE layer, spread over the DP ranks and given to the most loaded "
        "experts (docs/expert-load-balance.md); the experts plus these must split evenly over the ranks",
        metavar="N"))
    eplb_stats_file: str | None = field(default=None, metadata=flag(
        "expert-load statistics (JSON): read at startup to place the experts by their load, written back with "
        "the routed-token counts of this run added (every few minutes and at shutdown)", metavar="PATH",
        default_help="none: contiguous placement (or uniform, with redundant experts)"))
    eplb_step_interval: int | None = field(default=None, metadata=flag(
        "rebalance the experts while serving every N steps, from the loads counted since the previous "
        "rebalance (expert weights move between ranks between two steps)", metavar="N",
        default_help="never: the startup placement stays"))
    engram_storage: str | None = field(default=None, metadata=flag(
        "where the Engram tables live: gpu, or host (pinned memory, rows gathered by the GPU)",
        choices=("gpu", "host"), default_help="gpu when every weight fits in 80% of free GPU memory, else host"))
    enforce_eager: bool = field(default=False, metadata=flag(
        "never capture CUDA graphs: every step runs eagerly (on cuda, decode steps otherwise replay graphs)"))
    cuda_graph_sizes: tuple[int, ...] | None = field(default=None, metadata=flag(
        "decode batch sizes captured as CUDA graphs; a decode step of n sequences replays the smallest "
        "size >= n, padded", metavar="N", default_help="1 2 4 8, then every 8 up to --max-num-seqs"))
    max_seq_len_to_capture: int | None = field(default=None, metadata=flag(
        "longest context (tokens) a CUDA-graph decode step covers; a step with a longer sequence runs eagerly "
        "(beyond 8192 tokens, only power-of-two batch sizes, up to 2^23 rows x tokens per graph)",
        default_help="the longest context a sequence may reach (--max-model-len)"))

    @property
    def resolved_batch_invariant(self) -> bool:
        return self.device == "cpu" if self.batch_invariant is None else self.batch_invariant

    @property
    def cuda_graphs_off_reason(self) -> str | None:
        """Why decode steps run eagerly, or None when they replay CUDA graphs (workers/cuda_graphs.py)."""
        if self.device != "cuda":
            return "not on cuda"
        if self.enforce_eager:
            return "--enforce-eager"
        if self.resolved_kernels != "triton":
            return "the reference kernels read expert counts back to the host"
        if self.official_index_handoff:
            return "--official-index-handoff picks key layers on the host"
        return None

    @property
    def model_overrides(self) -> dict[str, Any]:
        """``--hf-overrides`` as a dict (empty when not given); ValueError if it is not a JSON object."""
        if self.hf_overrides is None:
            return {}
        try:
            overrides = json.loads(self.hf_overrides)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-overrides is not valid JSON: {exc}") from None
        if not isinstance(overrides, dict):
            raise ValueError("--hf-overrides must be a JSON object, e.g. '{\"num_hidden_layers\": 8}'")
        return overrides

    def model_config(self) -> V41Config:
        """The model's configuration as every process reads it: config.json with ``--hf-overrides``."""
        from model.config import V41Config

        return V41Config.from_pretrained(self.model, self.model_overrides)

    @property
    def resolved_kernels(self) -> str:
        return ("triton" if self.device == "cuda" else "reference") if self.kernels is None else self.kernels

    def __post_init__(self) -> None:
        if self.kernels not in (None, "reference", "triton"):
            raise ValueError(f"--kernels must be reference or triton, got {self.kernels!r}")
        if self.enable_pdl and self.resolved_kernels != "triton":
            raise ValueError("--enable-pdl needs --kernels triton (the default on cuda)")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        self.model_overrides  # noqa: B018 (a JSON object, or ValueError now rather than in every process)
        if not self.step_timeout > 0:
            raise ValueError("--step-timeout must be > 0")
        for name in ("dp_size", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_seqs_per_request",
                     "cpu_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.cuda_graph_sizes is not None and (not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1):
            raise ValueError("--cuda-graph-sizes must list batch sizes >= 1")
        if self.max_seq_len_to_capture is not None and self.max_seq_len_to_capture < 1:
            raise ValueError("--max-seq-len-to-capture must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be >= 2")
        if self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("--num-blocks must be >= 2 (block 0 is padding)")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ValueError("--num-state-slots must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if not self.cpu_kv_cache_gb > 0:
            raise ValueError("--cpu-kv-cache-gb must be > 0")
        if self.expert_capacity_factor is not None and not self.expert_capacity_factor > 0:
            raise ValueError("--expert-capacity-factor must be > 0")
        if self.num_redundant_experts < 0:
            raise ValueError("--num-redundant-experts must be >= 0")
        if self.eplb_step_interval is not None and self.eplb_step_interval < 1:
            raise ValueError("--eplb-step-interval must be >= 1")
        if self.dp_size == 1 and (self.num_redundant_experts or self.eplb_step_interval):
            raise ValueError("--num-redundant-experts and --eplb-step-interval need --data-parallel-size > 1 "
                             "(one rank holds every expert: there is nothing to balance)")
        if self.engram_storage not in (None, "gpu", "host"):
            raise ValueError(f"--engram-storage must be gpu or host, got {self.engram_storage!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError("--seed must be in [0, 2**63)")
        self._check_nodes()

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise ValueError("--nnodes must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not a node of --nnodes {self.nnodes} "
                             f"(0 .. {self.nnodes - 1})")
        if self.dp_size % self.nnodes:
            raise ValueError(f"--data-parallel-size {self.dp_size} is not a multiple of --nnodes {self.nnodes} "
                             "(every node runs dp / nnodes ranks)")
        if self.headless and self.node_rank == 0:
            raise ValueError("--headless is for the other nodes (--node-rank 1 and up): node 0 runs the frontend "
                             "and the engine core")
        if self.node_rank > 0 and not self.headless:
            raise ValueError(f"--node-rank {self.node_rank} runs only workers: add --headless")
        if not 1 <= self.master_port <= 65535 - 2:
            raise ValueError("--master-port must be in [1, 65533] (it and the next two ports are used)")
        if not self.master_addr:
            raise ValueError("--master-addr must not be empty")
        if not self.join_timeout > 0:
            raise ValueError("--join-timeout must be > 0")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags shared by ``serve`` and ``generate``, generated from ``EngineConfig``, and the
    vLLM recipe flags (``vllm_recipe_flags.py``)."""
    add_dataclass_flags(parser, EngineConfig, "engine")
    add_vllm_recipe_flags(parser)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration of parsed flags, with defaults resolved and checked against the
    model directory; ``EngineConfigError`` (one line) for anything that cannot run."""
    values = values_from_args(EngineConfig, args)
    values["model"] = _model_argument(args)
    if values.get("device") is None:
        import torch

        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        check_vllm_recipe_flags(vars(args))
        config = EngineConfig(**values)
    except ValueError as exc:
        raise EngineConfigError(str(exc)) from None
    check_engine_config(config)
    return config


def _model_argument(args: argparse.Namespace) -> str:
    """``serve MODEL`` or ``--model MODEL`` (not two different ones), else the embedded tiny model."""
    positional, flagged = getattr(args, "model_tag", None), getattr(args, "model", None)
    if positional and flagged and positional != flagged:
        raise EngineConfigError(f"two models given: {positional!r} and --model {flagged!r}")
    model = positional or flagged
    if model:
        return model
    from model.checkpoint_maker import default_model_dir

    return str(default_model_dir())


def check_engine_config(config: EngineConfig):
    """Check what needs the model directory or the machine; returns the model's ``V41Config``."""
    from model.config import ConfigError

    path = Path(config.model)
    if not path.exists():
        raise EngineConfigError(f"model directory {config.model} does not exist")
    if not path.is_dir():
        raise EngineConfigError(f"model path {config.model} is not a directory")
    try:
        cfg = config.model_config()
    except ConfigError as exc:
        raise EngineConfigError(str(exc)) from None
    if config.load_format == "auto" and not any(path.glob("*.safetensors")):
        raise EngineConfigError(f"no weights in {config.model} (no *.safetensors file); --load-format dummy "
                                "makes random weights from config.json alone")
    limit = cfg.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise EngineConfigError(f"--max-model-len {config.max_model_len} is larger than the model's limit of "
                                f"{limit} tokens (max_position_embeddings in config.json)")
    if config.num_blocks is not None and config.max_model_len is not None:
        kv_tokens = (config.num_blocks - 1) * config.block_size
        if kv_tokens < config.max_model_len:
            raise EngineConfigError(f"--num-blocks {config.num_blocks} holds {kv_tokens} tokens per rank, fewer "
                                    f"than --max-model-len {config.max_model_len}")
    if config.generation_config not in ("auto", "vllm") and not (Path(config.generation_config) /
                                                                  "generation_config.json").is_file():
        raise EngineConfigError(f"--generation-config {config.generation_config}: no generation_config.json there")
    if (cfg.num_routed_experts + config.num_redundant_experts) % config.dp_size:
        redundant = f" + {config.num_redundant_experts} redundant" if config.num_redundant_experts else ""
        raise EngineConfigError(f"--data-parallel-size {config.dp_size} does not divide the model's "
                                f"{cfg.num_routed_experts} routed experts{redundant} (each rank holds an equal share)")
    if config.num_redundant_experts > cfg.num_routed_experts * (config.dp_size - 1):
        raise EngineConfigError(f"--num-redundant-experts {config.num_redundant_experts} is more than one copy of "
                                f"each of the {cfg.num_routed_experts} experts on every other rank")
    if config.eplb_stats_file:
        from workers.expert_load_file import ExpertLoadFileError, read_expert_load

        try:
            read_expert_load(config.eplb_stats_file, cfg.num_layers, cfg.num_routed_experts)
        except ExpertLoadFileError as exc:
            raise EngineConfigError(f"--eplb-stats-file {exc}") from None
    _check_device(config)
    return cfg


def _check_device(config: EngineConfig) -> None:
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise EngineConfigError("--device cuda, but no CUDA device is available")
        per_node = config.dp_size // config.nnodes
        if per_node > torch.cuda.device_count():
            on = f" ({per_node} per node over --nnodes {config.nnodes})" if config.nnodes > 1 else ""
            raise EngineConfigError(f"--data-parallel-size {config.dp_size}{on} needs {per_node} GPUs; "
                                    f"{torch.cuda.device_count()} visible")
    elif config.resolved_kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise EngineConfigError("--kernels triton needs --device cuda (or TRITON_INTERPRET=1 to run the kernels "
                                "in Triton's interpreter)")
