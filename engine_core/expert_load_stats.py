"""The engine core's view of the expert load: the workers' reports summed into the imbalance gauge,
the per-rank counters of ``/metrics``, and the statistics file (``--eplb-stats-file``).

Workers send cumulative counters every few steps, all ranks in the same step
(``workers/expert_load.py``). Summed over the ranks, the per-slot counts say how many (token,
expert) pairs each rank's experts computed, per MoE layer (rank ``r`` holds slots ``r * S .. (r +
1) * S - 1``). The imbalance of the window between two reports is the sum over layers of the busiest
rank's pairs over the sum over layers of the mean rank's: how much longer the MoE layers take than
they would under a perfect balance, if a layer's time follows its busiest rank. Before any window
with tokens it is 1.0, and an idle window keeps the last value.

The file holds the routed-token counts of every run that wrote it: the counts it held when this run
started plus this run's (all ranks), rewritten every ``SAVE_INTERVAL_S`` while reports arrive and at
shutdown. A run that routed nothing leaves it as it was.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .protocol import SchedulerStats, StepResult

log = logging.getLogger(__name__)

SAVE_INTERVAL_S = 300.0


class ExpertLoadStats:
    def __init__(self, dp_size: int, stats_file: str | None):
        self.dp_size, self.path = dp_size, stats_file
        self.imbalance = 1.0
        self.rebalances = 0  # the same on every rank: they rebalance together
        self._routed: dict[int, np.ndarray] = {}  # rank -> cumulative [layers, experts]
        self._slots: dict[int, np.ndarray] = {}  # rank -> cumulative [layers, slots]
        self._rank_pairs: np.ndarray | None = None  # [layers, ranks] computed, at the last report
        self._previous_file = None  # the file's counts when this run started (ExpertLoadCounts)
        self._file_read = False
        self._last_save = time.monotonic()

    def add(self, results: list[StepResult]) -> None:
        """Take the reports of one step's results (every rank's, or none)."""
        reports = {r.rank: r.expert_load for r in results if r.expert_load is not None}
        if not reports:
            return
        for rank, report in reports.items():
            self._routed[rank] = _counts(report.routed, report.num_layers, report.num_experts)
            self._slots[rank] = _counts(report.slots, report.num_layers, report.num_slots)
            self.rebalances = max(self.rebalances, report.rebalances)
        slots = sum(self._slots.values())  # every rank's tokens: what each slot computed
        rank_pairs = slots.reshape(slots.shape[0], self.dp_size, -1).sum(axis=2)  # [layers, ranks]
        window = rank_pairs - self._rank_pairs if self._rank_pairs is not None else rank_pairs
        self._rank_pairs = rank_pairs
        mean = window.mean(axis=1).sum()
        if mean > 0:
            self.imbalance = float(window.max(axis=1).sum() / mean)
        if self.path and time.monotonic() - self._last_save > SAVE_INTERVAL_S:
            self.save()

    def fill(self, stats: SchedulerStats) -> SchedulerStats:
        """``stats`` with the expert-load fields set."""
        stats.expert_load_imbalance = self.imbalance
        pairs = self._rank_pairs.sum(axis=0).tolist() if self._rank_pairs is not None else [0] * self.dp_size
        stats.rank_expert_pairs = [int(p) for p in pairs]
        stats.expert_rebalances = self.rebalances
        return stats

    def save(self) -> None:
        """Write the statistics file (when one is configured and this run routed tokens); errors are
        logged, never raised: losing statistics must not take the engine down."""
        self._last_save = time.monotonic()
        if not self.path or not self._routed:
            return
        from workers.expert_load_file import ExpertLoadCounts, read_expert_load, write_expert_load

        routed = sum(self._routed.values())
        if not routed.any():
            return
        counts = ExpertLoadCounts(tuple(tuple(int(v) for v in row) for row in routed.tolist()))
        try:
            if not self._file_read:
                self._previous_file = read_expert_load(self.path, counts.num_layers, counts.num_experts)
                self._file_read = True
            if self._previous_file is not None:
                counts = self._previous_file + counts
            write_expert_load(self.path, counts)
        except (OSError, ValueError) as exc:
            log.warning("expert-load statistics not saved to %s: %s", self.path, exc)
            return
        log.info("expert-load statistics saved to %s (%d routed tokens in all)", self.path, counts.total)


def _counts(data: bytes, rows: int, columns: int) -> np.ndarray:
    values = np.frombuffer(data, dtype="<i8")
    if values.size != rows * columns:
        raise ValueError(f"an expert-load report of {values.size} counts for {rows} x {columns}")
    return values.reshape(rows, columns).astype(np.int64)
