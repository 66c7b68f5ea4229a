"""``DynamicFindOrInsert`` without the C++ library: the same rules, in NumPy.

Where the op library is not built (or ``TFHYBRID_DISABLE_CUSTOM_OPS=1``), a dynamic
table runs this instead, on the same variables, through ``tf.numpy_function``: it reads
the state, applies one call's rules (written in the header of
``tfhybrid/custom_ops/cc/kernels/dynamic_table_kernels.cc``) and writes the state back.
It gives the kernel's slots, bit for bit (``tests/test_dynamic_table.py`` holds the two
to each other), at Python speed: a portability path, not a fast one.

Example::

    import numpy as np
    from tfhybrid.dynamic.fallback import find_or_insert
    state = {"slot_keys": np.zeros(2, np.int64), "slot_seen": np.full(2, -1, np.int64),
             "slot_count": np.zeros(2, np.int32), "index": np.full(4, -1, np.int32),
             "cand_keys": np.zeros(1, np.int64), "cand_seen": np.full(1, -1, np.int64),
             "cand_count": np.zeros(1, np.int32), "cand_index": np.full(2, -1, np.int32),
             "counters": np.zeros(8, np.int64)}
    slots, new_slots, new_keys = find_or_insert(state, np.array([9, 3, 9]), 1)
    assert slots.tolist() == [1, 0, 1] and new_keys.tolist() == [3, 9]
"""

from __future__ import annotations

import numpy as np

WORD = (1 << 64) - 1
INT32_MAX = (1 << 31) - 1
_ADMISSIONS, _EVICTIONS, _REFUSALS, _HITS, _MISSES, _LIVE, _NEXT_FRESH, _CANDIDATES = range(8)


def _saturated(count: int) -> int:
    """Sightings as the kernel keeps them: int32, saturating."""
    return min(count, INT32_MAX)


def _mix(z: int) -> int:
    z &= WORD
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & WORD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & WORD
    return z ^ (z >> 31)


class _Index:
    """The kernel's SlotIndex: linear probing from the top bits of mix64(key)."""

    def __init__(self, buckets: np.ndarray, keys: np.ndarray):
        self.buckets, self.keys = buckets, keys
        self.mask = len(buckets) - 1
        self.shift = 64 - (len(buckets) - 1).bit_length()

    def home(self, key: int) -> int:
        return 0 if self.shift >= 64 else _mix(key) >> self.shift

    def find(self, key: int) -> int:
        b = self.home(key)
        while True:
            s = int(self.buckets[b])
            if s < 0:
                return -1
            if int(self.keys[s]) == key:
                return s
            b = (b + 1) & self.mask

    def insert(self, key: int, slot: int) -> None:
        b = self.home(key)
        while self.buckets[b] >= 0:
            b = (b + 1) & self.mask
        self.buckets[b] = slot

    def erase(self, key: int) -> None:
        hole = self.home(key)
        while True:
            s = int(self.buckets[hole])
            if s < 0:
                return
            if int(self.keys[s]) == key:
                break
            hole = (hole + 1) & self.mask
        j = (hole + 1) & self.mask
        while True:
            s = int(self.buckets[j])
            if s < 0:
                break
            home = self.home(int(self.keys[s]))
            stays = (hole < home <= j) if hole <= j else (home > hole or home <= j)
            if not stays:
                self.buckets[hole] = s
                hole = j
            j = (j + 1) & self.mask
        self.buckets[hole] = -1


def index_of(keys: np.ndarray, buckets: int) -> np.ndarray:
    """The kernel's index of ``buckets`` buckets over slots 0..len(keys)-1 holding
    ``keys``, inserted in slot order."""
    index = _Index(np.full([buckets], -1, np.int32), np.asarray(keys, np.int64))
    for slot, key in enumerate(index.keys.tolist()):
        index.insert(key, slot)
    return index.buckets


def find_or_insert(state: dict, keys: np.ndarray, call: int, admit_after: int = 1,
                   evict: str = "lfu", ttl: int = 0, pinned: int = 1,
                   insert: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One call of the kernel's rules on ``state`` (the op's variables by input name, as
    NumPy arrays, updated in place): (each key's slot, the slots given new keys, those
    keys)."""
    slot_keys, seen, count = state["slot_keys"], state["slot_seen"], state["slot_count"]
    counters = state["counters"]
    capacity = len(slot_keys)
    index = _Index(state["index"], slot_keys)
    keys = np.asarray(keys, np.int64).reshape(-1)
    distinct, occurs = np.unique(keys, return_counts=True)
    distinct = [int(k) for k in distinct]
    occurs = [int(n) for n in occurs]
    slot_of = [-1] * len(distinct)
    missing = []
    for i, key in enumerate(distinct):
        s = index.find(key)
        if not insert:
            slot_of[i] = s
        elif s >= 0:
            seen[s] = call
            count[s] = _saturated(int(count[s]) + int(occurs[i]))
            slot_of[i] = s
            counters[_HITS] += occurs[i]
        else:
            counters[_MISSES] += occurs[i]
            missing.append(i)
    free_slots = []
    next_fresh = int(counters[_NEXT_FRESH])
    if insert and (ttl > 0 or counters[_LIVE] < next_fresh):
        for s in range(next_fresh):
            if seen[s] >= 0 and ttl > 0 and call - seen[s] > ttl:
                index.erase(int(slot_keys[s]))
                seen[s] = -1
                count[s] = 0
                counters[_LIVE] -= 1
                counters[_EVICTIONS] += 1
            if seen[s] < 0:
                free_slots.append(s)
    if admit_after <= 1:
        admit = [(i, occurs[i]) for i in missing]
    else:
        admit = _admit(state, missing, distinct, occurs, call, admit_after)
    available = len(free_slots) + capacity - int(counters[_NEXT_FRESH])
    victims = []
    if len(admit) > available and evict != "none":
        eligible = [s for s in range(int(counters[_NEXT_FRESH]))
                    if seen[s] >= 0 and seen[s] <= call - pinned]
        if evict == "lfu":
            eligible.sort(key=lambda s: (int(count[s]), int(seen[s]), int(slot_keys[s])))
        else:
            eligible.sort(key=lambda s: (int(seen[s]), int(count[s]), int(slot_keys[s])))
        victims = eligible[:len(admit) - available]
    new_slots, new_keys = [], []
    for i, admitted_count in admit:
        if free_slots:
            s = free_slots.pop(0)
        elif counters[_NEXT_FRESH] < capacity:
            s = int(counters[_NEXT_FRESH])
            counters[_NEXT_FRESH] += 1
        elif victims:
            s = victims.pop(0)
            index.erase(int(slot_keys[s]))
            counters[_LIVE] -= 1
            counters[_EVICTIONS] += 1
        else:
            counters[_REFUSALS] += occurs[i]
            continue
        slot_keys[s] = distinct[i]
        seen[s] = call
        count[s] = _saturated(admitted_count)
        index.insert(distinct[i], s)
        counters[_LIVE] += 1
        counters[_ADMISSIONS] += 1
        slot_of[i] = s
        new_slots.append(s)
        new_keys.append(distinct[i])
    positions = np.searchsorted(np.array(distinct, np.int64), keys)
    slots = np.array(slot_of, np.int32)[positions] if len(keys) else np.zeros([0], np.int32)
    return slots, np.array(new_slots, np.int32), np.array(new_keys, np.int64)


def _admit(state: dict, missing: list, distinct: list, occurs: list, call: int,
           admit_after: int) -> list:
    """The kernel's Admit: (index into distinct, sightings) of the keys admitted."""
    keys, seen, count = state["cand_keys"], state["cand_seen"], state["cand_count"]
    counters = state["counters"]
    index = _Index(state["cand_index"], keys)
    cand_of = [-1] * len(missing)
    unlisted = []
    for m, i in enumerate(missing):
        c = index.find(distinct[i])
        if c >= 0:
            seen[c] = call
            count[c] = _saturated(int(count[c]) + int(occurs[i]))
            cand_of[m] = c
        else:
            unlisted.append(m)
    if unlisted:
        open_positions = [p for p in range(len(keys)) if seen[p] < 0]
        replaceable = sorted((p for p in range(len(keys)) if 0 <= seen[p] < call),
                             key=lambda p: (int(seen[p]), int(keys[p])))
        for m in unlisted:
            i = missing[m]
            if open_positions:
                c = open_positions.pop(0)
                counters[_CANDIDATES] += 1
            elif replaceable:
                c = replaceable.pop(0)
                index.erase(int(keys[c]))
            else:
                continue
            keys[c] = distinct[i]
            seen[c] = call
            count[c] = _saturated(int(occurs[i]))
            index.insert(distinct[i], c)
            cand_of[m] = c
    admit = []
    for m, i in enumerate(missing):
        c = cand_of[m]
        if c < 0 or count[c] < admit_after:
            continue
        admit.append((i, int(count[c])))
        index.erase(int(keys[c]))
        seen[c] = -1
        count[c] = 0
        counters[_CANDIDATES] -= 1
    return admit
