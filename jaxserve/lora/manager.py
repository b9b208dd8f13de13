"""Where adapters live: read into host memory (`AdapterCache`) and resident in the
device's slots (`SlotTable`). Host logic, no JAX: the scheduler asks the slot table
while it plans, and the engine writes the slots it assigns before the step runs.

Slots. Slot s (1..max_loras) holds one adapter, by content (`Adapter.key`); slot 0 is
"no adapter". A slot is *pinned* while running sequences use its adapter, and a
pinned slot is never rewritten, so a step never mixes more distinct adapters than
there are slots, and a sequence keeps its slot from admission until it finishes or
is preempted. A waiting sequence is admitted when its adapter is resident in a slot,
or when a slot nobody pins can take it (an empty one first, else the least recently
used): the slot is written (`take_loads`) before the step that needs it.

Fairness. When every slot is pinned, the oldest sequence (the scheduler asks in its
queue's order: priority, then arrival) whose adapter needs a slot *reserves* one:
the pinned slot with the fewest running sequences (then the least recently used).
A reserved slot admits no sequence of its current adapter that arrived after the
reservation was made (`horizon`: the newest arrival queued then), so it drains as
those finish (every sequence has a token limit) and then goes to the adapter that
reserved it: an adapter waiting for a slot gets one however many requests of the
resident adapters keep arriving, and requests of the other resident adapters (and
those without one) keep being admitted meanwhile. The requests already queued when
the reservation was made still join their adapter's slot: with a batch submitted
at once (16 requests over 8 adapters, 4 slots), every request of a resident
adapter runs in the first wave instead of one per adapter. A reservation whose
adapter has no sequence waiting any more is dropped (`keep_reservations`).

Host memory. `AdapterCache` keeps up to `max_cpu_loras` adapters read, by
`lora_int_id`, least recently used dropped first, but never one that a live
request uses: those stay (past the bound if need be), so that the slot writes of
waiting requests never read a file again.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from jaxserve.lora.peft import Adapter
from jaxserve.lora.request import LoRARequest


class AdapterCache:
    """Adapters read and checked, by `lora_int_id` (LRU over `capacity`, live ones kept)."""

    def __init__(self, capacity: int, load: Callable[[LoRARequest], Adapter]):
        self.capacity = capacity
        self._load = load
        self._entries: collections.OrderedDict[int, Adapter] = collections.OrderedDict()
        self._refs: collections.Counter[int] = collections.Counter()  # live requests per id
        self.num_reads = 0

    def get(self, request: LoRARequest, loaded: Adapter | None = None) -> Adapter:
        """The adapter `request` names, read (and checked) if it is not here, unless
        `loaded` is that adapter read already (off the engine's thread); raises
        ValueError naming the problem. An id names one adapter while requests use it."""
        i = request.lora_int_id
        adapter = self._entries.get(i)
        if adapter is not None and adapter.request != request:
            if self._refs[i]:
                old = adapter.request
                raise ValueError(
                    f"lora_int_id {i} is adapter {old.lora_name!r} ({old.lora_path}), in use "
                    f"by running requests; got {request.lora_name!r} ({request.lora_path}): "
                    "give another adapter another id"
                )
            del self._entries[i]
            adapter = None
        if adapter is None:
            if loaded is not None and loaded.request != request:
                raise RuntimeError(f"adapter {loaded.request} read, {request} asked for")
            adapter = loaded if loaded is not None else self._load(request)
            self.num_reads += 1
            self._entries[i] = adapter
        self._entries.move_to_end(i)
        self._shrink(keep=i)  # (not the one asked for: its request takes it next)
        return adapter

    def acquire(self, lora_int_id: int) -> None:
        """A live request uses the adapter: it stays in memory until `release`."""
        self._refs[lora_int_id] += 1

    def release(self, lora_int_id: int) -> None:
        self._refs[lora_int_id] -= 1
        if self._refs[lora_int_id] <= 0:
            del self._refs[lora_int_id]
        self._shrink()

    def in_use(self, lora_int_id: int) -> int:
        return self._refs[lora_int_id]

    def remove(self, lora_int_id: int) -> Adapter | None:
        """Forgets an adapter no live request uses (None: not here); ValueError if in use."""
        if self._refs[lora_int_id]:
            raise ValueError(
                f"lora_int_id {lora_int_id} is used by {self._refs[lora_int_id]} live "
                "request(s): it can be removed once they finish"
            )
        return self._entries.pop(lora_int_id, None)

    def by_key(self, key: str) -> Adapter:
        """The adapter read with content `key` (a live request's: it is here)."""
        for adapter in self._entries.values():
            if adapter.key == key:
                return adapter
        raise KeyError(f"no adapter with key {key} in host memory")

    def adapters(self) -> list[Adapter]:
        """The adapters in memory, least recently used first."""
        return list(self._entries.values())

    def _shrink(self, keep: int | None = None) -> None:
        for i in [i for i in self._entries if not self._refs[i] and i != keep]:
            if len(self._entries) <= self.capacity:
                return
            del self._entries[i]


class SlotTable:
    """The device's adapter slots 1..`num_slots`: which adapter each holds, how many
    running sequences pin it, and which are reserved for a waiting adapter."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.keys: list[str | None] = [None] * (num_slots + 1)  # [0]: no adapter, unused
        self.pins = [0] * (num_slots + 1)
        self._last_used = [0] * (num_slots + 1)
        self._clock = 0
        self.reserved: dict[int, str] = {}  # slot -> the adapter it drains for
        self._horizon: dict[int, int] = {}  # slot -> the newest arrival when reserved
        self._loads: list[tuple[int, str]] = []  # (slot, key) to write before the next step
        self.num_loads = 0
        self.num_evictions = 0  # loads that replaced a resident adapter

    def slot_of(self, key: str) -> int | None:
        """The slot holding adapter `key`, if any."""
        for s in range(1, self.num_slots + 1):
            if self.keys[s] == key:
                return s
        return None

    def claim(self, key: str, arrival: int = 0, horizon: int = 0) -> int | None:
        """A slot that holds (or is assigned now) adapter `key` for a sequence (that
        arrived `arrival`-th) to be admitted this step; None: the sequence waits (a
        reservation may be made, `horizon` the newest arrival queued now)."""
        self._clock += 1
        s = self.slot_of(key)
        if s is not None:
            if self.reserved.get(s, key) != key and arrival > self._horizon[s]:
                return None  # draining for another adapter
            self._last_used[s] = self._clock
            return s
        mine = next((s for s, k in self.reserved.items() if k == key), None)
        if mine is not None and self.pins[mine] == 0:
            return self._assign(mine, key)
        free = [
            s for s in range(1, self.num_slots + 1) if not self.pins[s] and s not in self.reserved
        ]
        if free:  # an empty slot first, else the least recently used
            return self._assign(
                min(free, key=lambda s: (self.keys[s] is not None, self._last_used[s])), key
            )
        if mine is None:
            open_ = [s for s in range(1, self.num_slots + 1) if s not in self.reserved]
            if open_:
                victim = min(open_, key=lambda s: (self.pins[s], self._last_used[s]))
                self.reserved[victim], self._horizon[victim] = key, horizon
        return None

    def _assign(self, slot: int, key: str) -> int:
        for s, k in list(self.reserved.items()):
            if k == key:
                del self.reserved[s]
        if self.keys[slot] is not None:
            self.num_evictions += 1
        self.keys[slot] = key
        self._last_used[slot] = self._clock
        self._loads.append((slot, key))
        self.num_loads += 1
        return slot

    def pin(self, slot: int) -> None:
        """A sequence using the slot's adapter starts running."""
        if slot:
            self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """A sequence using the slot's adapter stops running (finished or preempted)."""
        if slot:
            if self.pins[slot] <= 0:
                raise RuntimeError(f"LoRA slot {slot} unpinned more often than pinned")
            self.pins[slot] -= 1

    def keep_reservations(self, waiting: set[str]) -> None:
        """Drops the reservations of adapters no waiting sequence needs any more."""
        for s, key in list(self.reserved.items()):
            if key not in waiting:
                del self.reserved[s]

    def take_loads(self) -> list[tuple[int, str]]:
        """The (slot, adapter key) writes assigned since the last call, in order."""
        loads, self._loads = self._loads, []
        return loads

    def forget(self, key: str) -> bool:
        """Empties the slot of adapter `key` if no running sequence pins it."""
        s = self.slot_of(key)
        if s is None or self.pins[s]:
            return False
        self.keys[s] = None
        self._loads = [(slot, k) for slot, k in self._loads if slot != s]
        return True

    @property
    def num_in_use(self) -> int:
        """Slots holding an adapter."""
        return sum(k is not None for k in self.keys[1:])

    def check_invariant(self, running: dict[int, int]) -> None:
        """`running`: slot -> running sequences using it; pins must equal it."""
        for s in range(1, self.num_slots + 1):
            if self.pins[s] != running.get(s, 0):
                raise AssertionError(
                    f"LoRA slot {s}: {self.pins[s]} pins, {running.get(s, 0)} running sequences"
                )
            if self.pins[s] and self.keys[s] is None:
                raise AssertionError(f"LoRA slot {s} is pinned and empty")
