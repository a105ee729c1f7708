"""Admission and drain: the two ends of a request's life in the frontend.

Admission is one synchronous decision: ``reserve`` checks the capacity and counts the request's
engine sequences (prompts x ``n``) in the same step, with no ``await`` in between, so requests
arriving together can never all pass the check before any of them is counted. The reservation is
released when the request ends, however it ends (finished, aborted, failed), exactly once.

Capacity is ``max_running`` (sequences the engine runs at once, all DP ranks) plus
``max_queued`` (sequences allowed to wait). Fairness: one request may ask for at most
``per_request_limit`` sequences, the smaller of ``max_seqs_per_request`` and half the capacity,
so a single request can never fill the queue on its own; beyond it the request is refused with a
400 (it could never be served), while a full server answers 503 with ``Retry-After``.

Drain: once ``start_drain`` is called no request is admitted (503), and ``stop_all`` ends the
requests still in flight when the shutdown timeout runs out (each registered a stopper).
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import APIError, bad_request, overloaded, shutting_down


class Reservation:
    def __init__(self, admission: "Admission", num_seqs: int):
        self.admission, self.num_seqs = admission, num_seqs

    def release(self) -> None:
        """Give the sequences back (idempotent: every way out of a request may call it)."""
        if self.num_seqs:
            self.admission.in_flight -= self.num_seqs
            self.num_seqs = 0


class Admission:
    def __init__(self, max_running: int, max_queued: int, max_seqs_per_request: int):
        self.capacity = max(1, max_running + max_queued)
        self.per_request_limit = max(1, min(max_seqs_per_request, self.capacity // 2))
        self.in_flight = 0  # engine sequences admitted and not yet released
        self.draining = False
        self._stoppers: set[Callable[[], None]] = set()

    def check_size(self, num_seqs: int) -> None:
        """Refuse a request larger than one request may ever be (checked before any tokenizing)."""
        if num_seqs > self.per_request_limit:
            raise bad_request(f"this request asks for {num_seqs} sequences (prompts x n); at most "
                              f"{self.per_request_limit} are allowed per request", "n")

    def reserve(self, num_seqs: int) -> Reservation:
        if self.draining:
            raise shutting_down()
        self.check_size(num_seqs)
        if self.in_flight + num_seqs > self.capacity:
            raise overloaded(f"the server is overloaded ({self.in_flight} of {self.capacity} sequences in "
                             "flight), retry later")
        self.in_flight += num_seqs
        return Reservation(self, num_seqs)

    # ------------------------------------------------------------------ drain
    def start_drain(self) -> None:
        self.draining = True

    def track(self, stopper: Callable[[], None]) -> Callable[[], None]:
        """Register how to stop one in-flight request at the drain deadline; returns the unregister."""
        self._stoppers.add(stopper)
        return lambda: self._stoppers.discard(stopper)

    @property
    def active(self) -> int:
        """Requests in flight (streams and non-streaming requests still running)."""
        return len(self._stoppers)

    def stop_all(self) -> int:
        stoppers = list(self._stoppers)
        for stop in stoppers:
            stop()
        return len(stoppers)


__all__ = ["Admission", "APIError", "Reservation"]
