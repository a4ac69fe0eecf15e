"""llama.cpp's DRY samplers kept by their settings, for each sequence's chain to clone
(`workers.engine.samplers` builds the chains; the engine keeps one set, shared by every
slot's chain through its `Candidates`). With the `llama_cpp` module the engine hands
over, so nothing here imports llama.cpp before the worker is pinned."""
from __future__ import annotations

import ctypes
import threading

from dispatcher.common.tenantlru import TenantLRU


KEPT_DRY = 8    # DRY samplers kept to clone from, by their settings


class DryTemplates:
    """DRY samplers kept by their settings, each sequence's a clone of one. llama.cpp's
    DRY init scans the whole vocabulary for every sequence breaker (Gemma 3's 262k
    tokens: 0.1 s of a core for llama.cpp's four default breakers, 0.9 s for sixteen),
    and a request's n choices, or an editor's requests with the same settings, would pay
    it each time; a clone copies the scanned table (milliseconds). Any thread; the
    scan runs outside the lock (the GIL released), so one settings' scan holds up no
    other chain."""

    def __init__(self, lib, vocab):
        self.lib, self.vocab = lib, vocab
        self.kept = TenantLRU(KEPT_DRY, on_evict=lib.llama_sampler_free)
        self.lock = threading.Lock()

    def sampler(self, multiplier: float, base: float, allowed_length: int, window: int,
                breakers: tuple[str, ...], tenant: str | None = None):
        """A new DRY sampler of these settings (None where llama.cpp could not make one);
        the caller owns it. Kept per `tenant`: a scan another key had made answered
        sooner, an oracle of its settings."""
        key = (multiplier, base, allowed_length, window, breakers)
        with self.lock:
            template = self.kept.get(tenant, key)
            if template is not None:
                return self.lib.llama_sampler_clone(template)
        encoded = [b.encode() for b in breakers]
        array = (ctypes.c_char_p * max(1, len(encoded)))(*encoded)
        made = self.lib.llama_sampler_init_dry(self.vocab, multiplier, base, allowed_length,
                                               window, array, len(encoded))
        if not made:
            return None
        with self.lock:
            kept = self.kept.setdefault(tenant, key, made)
            if kept is not made:                     # another thread made it meanwhile
                self.lib.llama_sampler_free(made)
            return self.lib.llama_sampler_clone(kept)

    def close(self) -> None:
        with self.lock:
            for template in self.kept.values():
                self.lib.llama_sampler_free(template)
            self.kept.clear()
