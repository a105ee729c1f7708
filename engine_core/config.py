"""Engine configuration: the command-line flags, resolved once into a frozen dataclass."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint directory
    device: str = "cpu"  # "cpu" or "cuda"
    dp_size: int = 1  # data-parallel ranks (one worker process each); experts are sharded over them
    max_num_seqs: int = 64  # running sequences per DP rank
    max_num_batched_tokens: int = 512  # prefill tokens per step per DP rank
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 128  # source tokens per KV block
    num_blocks: int | None = None  # KV blocks per rank (default: from the memory budget)
    num_state_slots: int | None = None  # state slots per rank (default: max_num_seqs)
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the worker may use, caches included
    cpu_kv_cache_gb: float = 1.0  # memory budget of the caches on CPU
    cpu_threads: int = 1  # intra-op threads of a CPU worker (small models run fastest on one)
    zos: bool = True  # zero-overhead scheduling: plan step N+1 while step N runs
    batch_invariant: bool | None = None  # default: on for CPU, off for CUDA
    official_index_handoff: bool = False  # reproduce the reference's index-key hand-off quirk
    max_queued_requests: int = 1024  # waiting requests beyond this get 503 (frontend)
    max_seqs_per_request: int = 256  # prompts x n of one request; more gets a 400 (frontend)
    step_timeout: float = 120.0  # seconds a step may take before its rank is declared stuck
    kernels: str | None = None  # kernel backend: reference | triton (default: triton on CUDA, reference on CPU)
    load_format: str = "auto"  # auto (safetensors files) | dummy (random weights made on the device)

    @property
    def resolved_batch_invariant(self) -> bool:
        return self.device == "cpu" if self.batch_invariant is None else self.batch_invariant

    @property
    def resolved_kernels(self) -> str:
        return ("triton" if self.device == "cuda" else "reference") if self.kernels is None else self.kernels

    def __post_init__(self) -> None:
        if self.kernels not in (None, "reference", "triton"):
            raise ValueError(f"--kernels must be reference or triton, got {self.kernels!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if not self.step_timeout > 0:
            raise ValueError("--step-timeout must be > 0")
        for name in ("dp_size", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_seqs_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("--num-blocks must be >= 2 (block 0 is padding)")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ValueError("--num-state-slots must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags shared by ``serve`` and ``generate``."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    g.add_argument("--dp", dest="dp_size", type=int, default=1, help="data-parallel ranks (worker processes)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=128)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks per DP rank (overrides the budget)")
    g.add_argument("--num-state-slots", type=int, default=None, help="state slots per DP rank")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--cpu-kv-cache-gb", type=float, default=1.0)
    g.add_argument("--cpu-threads", type=int, default=1, help="intra-op threads per CPU worker")
    g.add_argument("--no-zos", dest="zos", action="store_false", help="turn off zero-overhead scheduling")
    bi = g.add_mutually_exclusive_group()
    bi.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=None,
                    help="every row's result independent of the batch (default on CPU)")
    bi.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false")
    g.add_argument("--official-index-handoff", action="store_true",
                   help="reproduce the reference's index-key hand-off on decode steps (see model/transformer.py)")
    g.add_argument("--max-queued-requests", type=int, default=1024)
    g.add_argument("--max-seqs-per-request", type=int, default=256,
                   help="largest number of sequences (prompts x n) one request may ask for")
    g.add_argument("--step-timeout", type=float, default=120.0,
                   help="seconds a step may take before its rank is declared stuck and the server exits")
    g.add_argument("--kernels", choices=["reference", "triton"], default=None,
                   help="kernel backend of the FP8/FP4 products (default: triton on cuda, reference on cpu)")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights in their storage formats made on the device; the model "
                        "directory needs only config.json and a tokenizer (make-checkpoint --config-only)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from model.checkpoint_maker import default_model_dir

    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    if values.get("model") is None:
        values["model"] = str(default_model_dir())
    if values.get("device") is None:
        import torch

        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig(**{k: v for k, v in values.items() if v is not None or k in ("batch_invariant", "kernels")})
