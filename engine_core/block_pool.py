"""A fixed set of ids with reference counts: used for paged KV blocks and for state slots.

An id goes back to the free list only when its count drops to zero, and ids are handed out in
FIFO order of release, so allocation is deterministic. KV blocks reserve id 0 as the padding
target of unused block-table entries; state slots use every id.
"""

from __future__ import annotations

from collections import deque


class PoolExhausted(RuntimeError):
    pass


class RefCountedPool:
    def __init__(self, size: int, reserved: int = 0, name: str = "pool"):
        if size <= reserved:
            raise ValueError(f"{name}: size {size} leaves nothing after {reserved} reserved ids")
        self.name = name
        self.reserved = reserved
        self.capacity = size - reserved
        self._refcount = [0] * size
        self._free: deque[int] = deque(range(reserved, size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{self.name}: {n} requested, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._refcount[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            if self._refcount[i] <= 0:
                raise ValueError(f"{self.name}: incref of free id {i}")
            self._refcount[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self._refcount[i] <= 0:
                raise ValueError(f"{self.name}: id {i} freed twice")
            self._refcount[i] -= 1
            if self._refcount[i] == 0:
                self._free.append(i)
