"""A small cache of work kept for tenants (API keys): what one key's requests made
(a grammar's check, a schema's conversion, a DRY sampler's scan, a long text's tokens)
kept for that key alone, within one bound for all keys together.

Kept per tenant so that another key's entry never answers sooner (a timing oracle of
what it sent); bounded together, as a cache of a process is. Past the bound the tenant
holding the most entries loses its least recently used one (of tenants holding as many,
the one whose oldest entry is oldest): a key sending many distinct items pushes out its
own entries, never another key's while it holds more than that key. With one tenant it
is a plain least-recently-used cache. Safe from several threads (its own lock)."""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Callable, Hashable

_MISSING = object()


class TenantLRU:
    """(tenant, key) -> value, at most `size` entries in all. `on_evict(value)` is called
    for each value pushed out, under this cache's lock (e.g. to free what it holds; it
    must not ask this cache again: the lock is not reentrant)."""

    def __init__(self, size: int, on_evict: Callable[[object], None] | None = None):
        if size < 1:
            raise ValueError("a TenantLRU holds one entry at least")
        self.size, self.on_evict = size, on_evict
        self._tenants: dict[Hashable, OrderedDict] = {}    # tenant -> key -> (stamp, value)
        self._count = 0
        self._stamps = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._count

    def __contains__(self, where: tuple) -> bool:
        tenant, key = where
        with self._lock:
            return key in self._tenants.get(tenant, ())

    def get(self, tenant: Hashable, key: Hashable, default=None):
        """The value kept for `tenant` under `key` (now its most recently used), or
        `default`."""
        with self._lock:
            entries = self._tenants.get(tenant)
            found = entries.get(key, _MISSING) if entries is not None else _MISSING
            if found is _MISSING:
                return default
            entries[key] = (next(self._stamps), found[1])
            entries.move_to_end(key)
            return found[1]

    def put(self, tenant: Hashable, key: Hashable, value) -> None:
        """Keep `value` for `tenant` under `key` (replacing one kept there, which is not
        passed to `on_evict`), then back within the bound."""
        with self._lock:
            entries = self._tenants.setdefault(tenant, OrderedDict())
            if key not in entries:
                self._count += 1
            entries[key] = (next(self._stamps), value)
            entries.move_to_end(key)
            while self._count > self.size:
                self._evict_one()

    def setdefault(self, tenant: Hashable, key: Hashable, value):
        """The value kept under `key` if there is one (now most recently used), else
        `value`, kept: for a value made outside the lock that another thread may have
        made meanwhile."""
        with self._lock:
            entries = self._tenants.setdefault(tenant, OrderedDict())
            found = entries.get(key, _MISSING)
            if found is _MISSING:
                self._count += 1
            else:
                value = found[1]
            entries[key] = (next(self._stamps), value)
            entries.move_to_end(key)
            while self._count > self.size:
                self._evict_one()
            return value

    def _evict_one(self) -> None:
        victim = max(self._tenants,
                     key=lambda t: (len(self._tenants[t]),
                                    -next(iter(self._tenants[t].values()))[0]))
        entries = self._tenants[victim]
        _, (_, value) = entries.popitem(last=False)
        self._count -= 1
        if not entries:
            del self._tenants[victim]
        if self.on_evict is not None:
            self.on_evict(value)

    def values(self) -> list:
        with self._lock:
            return [value for entries in self._tenants.values()
                    for _, value in entries.values()]

    def tenants(self) -> dict[Hashable, int]:
        """How many entries each tenant holds."""
        with self._lock:
            return {tenant: len(entries) for tenant, entries in self._tenants.items()}

    def clear(self) -> None:
        """Forget every entry (`on_evict` is not called: the caller frees what it owns)."""
        with self._lock:
            self._tenants.clear()
            self._count = 0
