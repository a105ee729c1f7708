"""One log format for every process: the frontend (uvicorn's loggers included), the engine core
and each worker, so interleaved lines on one terminal say who wrote them:

    12-01 07:12:17.638 INFO  [worker-dp1 pid=4242] model.loader: weights: 1.20 GiB held on cuda:1 ...

``configure_logging`` is called once at the start of each process with the ``--log-level`` the
user gave, which the frontend hands down to the engine core and the workers. It replaces its own
handler when called again (tests run several commands in one process) and writes to whatever
``sys.stderr`` is at the time of each record (pytest swaps it per test).
"""

from __future__ import annotations

import logging
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DATE_FORMAT = "%m-%d %H:%M:%S"


def log_format(process: str) -> str:
    return f"%(asctime)s.%(msecs)03d %(levelname)-5s [{process} pid=%(process)d] %(name)s: %(message)s"


def worker_process_name(rank: int) -> str:
    return f"worker-dp{rank}"


class _CurrentStderr(logging.StreamHandler):
    """A stream handler on the ``sys.stderr`` of the moment."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def configure_logging(level: str, process: str) -> None:
    """Root logging at ``level`` in the shared format, labelled with ``process`` (and the pid)."""
    level = level.upper()
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _CurrentStderr):
            root.removeHandler(handler)
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter(log_format(process), DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # Python warnings become WARNING lines in the same format
    # uvicorn's loggers carry no handlers of their own (the server passes log_config=None): they
    # propagate here; their levels follow ours
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logging.getLogger(name).setLevel(logging.NOTSET)
