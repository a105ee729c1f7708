"""The HTTP server's own settings (``mini-deepinfer serve`` beyond the engine's): one frozen
dataclass that also declares the flags (see ``engine_core.cli_options``), resolved once."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field

from engine_core.cli_options import add_dataclass_flags, flag, values_from_args

API_KEY_ENV = "MINI_DEEPINFER_API_KEY"  # so the key need not appear in `ps`
DEFAULT_METRICS_PREFIX = "minideepinfer"


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=flag("address to listen on"))
    port: int = field(default=8000, metadata=flag("port to listen on"))
    served_model_name: tuple[str, ...] | None = field(default=None, metadata=flag(
        "the name(s) the API accepts as `model` and /v1/models lists; the first is used in responses "
        "and in the metrics' model_name label", metavar="NAME", default_help="the model directory's name"))
    api_key: str | None = field(default=None, metadata=flag(
        f"require 'Authorization: Bearer <key>' (or set {API_KEY_ENV}, which keeps it out of ps)",
        default_help=f"${API_KEY_ENV}, else no key"))
    metrics_require_key: bool = field(default=False, metadata=flag("/metrics requires the API key too"))
    allowed_origins: str | None = field(default=None, metadata=flag(
        "comma-separated CORS origins ('*' allows any, without credentials)", default_help="no CORS"))
    max_request_bytes: int = field(default=8 << 20, metadata=flag("largest request body in bytes; larger get 413"))
    shutdown_timeout: float = field(default=30.0, metadata=flag(
        "seconds requests in flight may finish after SIGTERM/SIGINT before they are stopped"))
    disable_log_requests: bool = field(default=False, metadata=flag(
        "no log line per finished request (id, tokens in/out, TTFT, total time)"))
    disable_log_stats: bool = field(default=False, metadata=flag(
        "no periodic stats line (throughput, running/waiting, KV and slot usage); /metrics is unaffected"))
    log_stats_interval: float = field(default=5.0, metadata=flag("seconds between two stats lines while busy"))
    disable_uvicorn_access_log: bool = field(default=False, metadata=flag("no uvicorn line per HTTP request"))
    metrics_prefix: str = field(default=DEFAULT_METRICS_PREFIX, metadata=flag(
        "prefix of every metric name on /metrics (PREFIX:num_requests_running, ...)"))
    vllm_metrics_alias: bool = field(default=True, metadata=flag(
        "also export the metrics vLLM defines under their vllm: names, so vLLM dashboards work unchanged",
        negative="--no-vllm-metrics-alias"))

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError("--max-request-bytes must be >= 1")
        if self.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if not self.log_stats_interval > 0:
            raise ValueError("--log-stats-interval must be > 0")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.metrics_prefix):
            raise ValueError(f"--metrics-prefix must be letters, digits and '_' (not first a digit), "
                             f"got {self.metrics_prefix!r}")
        if self.served_model_name is not None and (not self.served_model_name or not all(self.served_model_name)):
            raise ValueError("--served-model-name needs at least one non-empty name")

    @property
    def resolved_api_key(self) -> str | None:
        """``--api-key``, else the MINI_DEEPINFER_API_KEY environment variable."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]

    def model_names(self, model_dir: str) -> tuple[str, ...]:
        from pathlib import Path

        return self.served_model_name or (Path(model_dir).resolve().name,)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_flags(parser, ServerConfig, "server")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server settings of parsed flags; ValueError (one line) for incompatible ones."""
    config = ServerConfig(**values_from_args(ServerConfig, args))
    if config.metrics_require_key and config.resolved_api_key is None:
        raise ValueError(f"--metrics-require-key needs an API key (--api-key or {API_KEY_ENV})")
    return config
