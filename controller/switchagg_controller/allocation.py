"""Slot ranges in the aggregators' pools: the P4 switch's and the software aggregator's.

Jobs get contiguous ranges that never overlap; a job that does not fit on the preferred data
plane is placed on the other one when that is allowed (the software fallback), and the
placement says where it went.
"""

from __future__ import annotations

from dataclasses import dataclass

from switchagg import protocol

P4 = "p4"
SOFTWARE = "software"
TWO_LEVEL = "two-level"  # software leaves behind a software spine (two_level_plane.py)
SW_POOL_SLOTS = protocol.POOL_SLOT_MASK + 1  # 32768: the pool field's 15 bits


class AllocationError(Exception):
    """A slot range could not be placed; the message says why."""


@dataclass(frozen=True)
class Placement:
    data_plane: str  # P4, SOFTWARE or TWO_LEVEL
    slot_base: int
    slot_count: int
    pools: tuple[str, ...] = ()  # the pools the range is taken from on all; () means (data_plane,)

    @property
    def pool_keys(self) -> tuple[str, ...]:
        return self.pools or (self.data_plane,)


class SlotPool:
    """First-fit allocation of contiguous ranges in 0..size-1."""

    def __init__(self, name: str, size: int) -> None:
        if size <= 0:
            raise ValueError(f"pool {name!r} needs a positive size, not {size}")
        self.name = name
        self.size = size
        self._used: dict[int, int] = {}  # base -> count

    def allocate(self, count: int) -> int:
        base = self.first_fit(count)
        self._used[base] = count
        return base

    def first_fit(self, count: int, start: int = 0) -> int:
        """The lowest base >= ``start`` of a free range of ``count`` slots (nothing is taken)."""
        if not 1 <= count <= self.size:
            raise AllocationError(f"{self.name}: a job needs 1..{self.size} slots, not {count}")
        base = start
        for used_base, used_count in sorted(self._used.items()):
            if used_base + used_count <= base:
                continue
            if used_base - base >= count:
                break
            base = max(base, used_base + used_count)
        if base + count > self.size:
            raise AllocationError(
                f"{self.name}: no free range of {count} slots ({self.free_slots()} of {self.size} free)"
            )
        return base

    def reserve(self, base: int, count: int) -> None:
        """Marks a known range as used (reloading saved jobs); refuses overlaps."""
        if base < 0 or count < 1 or base + count > self.size:
            raise AllocationError(f"{self.name}: range {base}+{count} is outside 0..{self.size - 1}")
        for used_base, used_count in self._used.items():
            if base < used_base + used_count and used_base < base + count:
                raise AllocationError(f"{self.name}: range {base}+{count} overlaps {used_base}+{used_count}")
        self._used[base] = count

    def free(self, base: int) -> None:
        if self._used.pop(base, None) is None:
            raise AllocationError(f"{self.name}: no range starts at slot {base}")

    def free_slots(self) -> int:
        return self.size - sum(self._used.values())

    def ranges(self) -> list[tuple[int, int]]:
        return sorted(self._used.items())


class SlotAllocator:
    """The pools of the data planes this controller runs. Used only on the controller's event
    loop, and no method awaits: it needs no lock."""

    def __init__(
        self,
        p4_slots: int | None = protocol.P4_NUM_SLOTS,
        sw_slots: int | None = SW_POOL_SLOTS,
        pools: dict[str, int] | None = None,
    ):
        """``pools``: more pools by key (e.g. one per software leaf and spine) -> size."""
        self._pools: dict[str, SlotPool] = {k: SlotPool(k, size) for k, size in (pools or {}).items()}
        if p4_slots:
            self._pools[P4] = SlotPool("P4 switch pool", p4_slots)
        if sw_slots:
            self._pools[SOFTWARE] = SlotPool("software aggregator pool", sw_slots)
        if not self._pools:
            raise ValueError("an allocator needs at least one pool")

    def has(self, data_plane: str) -> bool:
        return data_plane in self._pools

    def add_pool(self, key: str, size: int) -> None:
        """A pool of its own (e.g. one per software leaf and spine of a two-level data plane)."""
        if key in self._pools:
            raise ValueError(f"pool {key!r} exists already")
        self._pools[key] = SlotPool(key, size)

    def place_on_all(self, data_plane: str, keys: tuple[str, ...], count: int) -> Placement:
        """One range of ``count`` slots free in every pool of ``keys`` (a two-level job has the
        same slots on each switch it crosses), taken from all of them."""
        missing = [k for k in keys if k not in self._pools]
        if missing or not keys:
            raise AllocationError(f"no slot pool {', '.join(missing) or '(none)'} is configured")
        pools = [self._pools[k] for k in keys]
        base = 0
        while True:  # raise the base until every pool agrees; each round moves it up or ends
            fits = [p.first_fit(count, base) for p in pools]
            if all(b == base for b in fits):
                break
            base = max(fits)
        for p in pools:
            p.reserve(base, count)
        return Placement(data_plane, base, count, tuple(keys))

    def place(self, wants: list[tuple[str, int]]) -> Placement:
        """Places a range on the first (data plane, slot count) choice that fits."""
        if not wants:
            raise AllocationError("no data plane to place the job on")
        reasons = []
        for data_plane, count in wants:
            pool = self._pools.get(data_plane)
            if pool is None:
                reasons.append(f"no {data_plane} data plane is configured")
                continue
            try:
                return Placement(data_plane, pool.allocate(count), count)
            except AllocationError as e:
                reasons.append(str(e))
        raise AllocationError("; ".join(reasons))

    def reserve(self, placement: Placement) -> None:
        missing = [k for k in placement.pool_keys if k not in self._pools]
        if missing:
            raise AllocationError(f"no {placement.data_plane} data plane pool {', '.join(missing)}")
        done = []
        try:
            for key in placement.pool_keys:
                self._pools[key].reserve(placement.slot_base, placement.slot_count)
                done.append(key)
        except AllocationError:
            for key in done:
                self._pools[key].free(placement.slot_base)
            raise

    def release(self, placement: Placement) -> None:
        for key in placement.pool_keys:
            self._pools[key].free(placement.slot_base)

    def ranges(self, data_plane: str) -> list[tuple[int, int]]:
        return self._pools[data_plane].ranges()

    def free_slots(self, data_plane: str) -> int:
        return self._pools[data_plane].free_slots()
