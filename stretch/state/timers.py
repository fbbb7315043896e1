"""Timers as keyed state in shared memory.

Per key group, one binary min-heap of (timestamp, row) per time domain, and per key the sorted set
of its timers (registration is idempotent, deletion removes from the set and the heap entry is
skipped when it surfaces). Both live in the operator's state arena under the key group, so timers
follow their key group through a rescale exactly as the other state does: nothing is copied.
"""

from __future__ import annotations

import numpy as np

from stretch.state import _table_kernels as K
from stretch.state.keyed_table import KeyedTable, pow2

EVENT, PROCESSING = 0, 1
_NEVER = np.iinfo(np.int64).max
_POP_CHUNK = 4096


class TimerStore:
    """Bulk timer operations for the key groups an instance owns."""

    def __init__(self, table: KeyedTable):
        self.table = table
        arena = table.arena
        self.heaps = [
            arena.register_state(
                {"name": f"__timers_{d}", "kind": "timer_heap", "storage": "heap", "type": None}
            )
            for d in ("event", "processing")
        ]
        self.sets = [
            arena.register_state(
                {"name": f"__timer_set_{d}", "kind": "timer_set", "storage": "var", "type": None}
            )
            for d in ("event", "processing")
        ]

    # ---- per-key sets ------------------------------------------------------------------
    def _load_sets(self, domain: int, kgs: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
        raw = self.table.read_var(self.sets[domain], kgs, rows)
        return [np.zeros(0, np.int64) if r is None else np.frombuffer(r, np.int64).copy() for r in raw]

    def _store_sets(self, domain: int, kgs, rows, sets: list[np.ndarray]) -> None:
        payloads = [s.tobytes() if len(s) else None for s in sets]
        self.table.write_var(self.sets[domain], kgs, rows, payloads)

    # ---- heaps -------------------------------------------------------------------------
    def _push(self, domain: int, kgs: np.ndarray, rows: np.ndarray, stamps: np.ndarray) -> None:
        if not len(kgs):
            return
        sid = self.heaps[domain]
        cols = self.table._state_words(sid)
        need = np.bincount(kgs, minlength=self.table.maxp)
        for kg in np.flatnonzero(need):
            c = cols[kg]
            used, cap = int(c[K.S_HEAP_USED]), int(c[K.S_DATA_CAP])
            if used + need[kg] > cap:
                new_cap = pow2(max(64, used + int(need[kg])))
                c[K.S_DATA_OFF] = self.table._move(int(c[K.S_DATA_OFF]), cap * 16, used * 16, new_cap * 16)
                c[K.S_DATA_CAP] = new_cap
        K.heap_push(self.table.arena.a64, self.table.arena.state_base_w(sid), kgs, rows, stamps)

    # ---- public ------------------------------------------------------------------------
    def apply(
        self, domain: int, kgs: np.ndarray, rows: np.ndarray, ops: list[list[tuple[int, bool]]]
    ) -> None:
        """Apply, per key (kgs[i], rows[i]), its list of (timestamp, register?) operations in order."""
        if not len(kgs):
            return
        sets = self._load_sets(domain, kgs, rows)
        push_kg, push_row, push_ts = [], [], []
        for i, key_ops in enumerate(ops):
            current = set(sets[i].tolist())
            for ts, register in key_ops:
                if register and ts not in current:
                    current.add(ts)
                    push_kg.append(kgs[i])
                    push_row.append(rows[i])
                    push_ts.append(ts)
                elif not register:
                    current.discard(ts)
            sets[i] = np.array(sorted(current), dtype=np.int64)
        self._store_sets(domain, kgs, rows, sets)
        self._push(
            domain,
            np.array(push_kg, dtype=np.uint16),
            np.array(push_row, dtype=np.int64),
            np.array(push_ts, dtype=np.int64),
        )

    def next_due(self, domain: int, owned: np.ndarray) -> int:
        """The earliest timer of these key groups (int64 max if none)."""
        if not len(owned):
            return _NEVER
        heads = np.empty(len(owned), dtype=np.int64)
        K.heap_heads(self.table.arena.a64, self.table.arena.state_base_w(self.heaps[domain]), owned, heads)
        return int(heads.min())

    def pop_due(self, domain: int, owned: np.ndarray, limit: int):
        """Remove and return the timers due at ``limit`` in these key groups: (stamps, kgs, rows),
        in timestamp order. Entries deleted since they were registered are skipped."""
        base_w = self.table.arena.state_base_w(self.heaps[domain])
        stamps, kgs, rows = [], [], []
        out_ts = np.empty(_POP_CHUNK, dtype=np.int64)
        out_rows = np.empty(_POP_CHUNK, dtype=np.int64)
        for kg in owned.tolist():
            while True:
                n = K.heap_pop_due(self.table.arena.a64, base_w, kg, limit, out_ts, out_rows)
                if n:
                    stamps.append(out_ts[:n].copy())
                    rows.append(out_rows[:n].copy())
                    kgs.append(np.full(n, kg, dtype=np.uint16))
                if n < _POP_CHUNK:
                    break
        if not stamps:
            return np.zeros(0, np.int64), np.zeros(0, np.uint16), np.zeros(0, np.int64)
        stamps_a, kgs_a, rows_a = np.concatenate(stamps), np.concatenate(kgs), np.concatenate(rows)
        # keep only timers still registered, and take them out of their keys' sets
        code = (kgs_a.astype(np.int64) << 40) | rows_a
        _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        ukgs, urows = kgs_a[first], rows_a[first]
        sets = self._load_sets(domain, ukgs, urows)
        live = np.zeros(len(stamps_a), dtype=bool)
        for j in range(len(stamps_a)):
            s = sets[inverse[j]]
            pos = np.searchsorted(s, stamps_a[j])
            if pos < len(s) and s[pos] == stamps_a[j]:
                live[j] = True
                sets[inverse[j]] = np.delete(s, pos)
        self._store_sets(domain, ukgs, urows, sets)
        order = np.lexsort((rows_a[live], kgs_a[live], stamps_a[live]))
        return stamps_a[live][order], kgs_a[live][order], rows_a[live][order]

    def registered(self, domain: int, kgs: np.ndarray, rows: np.ndarray) -> list[list[int]]:
        """Each key's pending timers (for tests and queries)."""
        return [s.tolist() for s in self._load_sets(domain, kgs, rows)]
