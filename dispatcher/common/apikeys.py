"""API keys: where they come from (flags, the variable, the key file's `KEY NAME`
lines), the names they are counted under, and the fingerprint every part logs and
counts a key by (never the key itself)."""
from __future__ import annotations

import hashlib


def load_keys(inline: str | None, path: str | None) -> list[bytes]:
    """The API keys: comma-separated inline ones, then the file's, one per line."""
    return [key for key, _ in load_named_keys(inline, path)]


def load_named_keys(inline: str | None, path: str | None) -> list[tuple[bytes, str]]:
    """The API keys with the name each is counted under: the file's `KEY NAME` lines name
    theirs; any other key goes by `key-` and its fingerprint (never the key itself)."""
    named = [(k.strip(), "") for k in (inline or "").split(",") if k.strip()]
    if path:
        before = len(named)
        # (utf-8-sig: an editor's byte-order mark made the first key another, silently)
        for line in open(path, encoding="utf-8-sig").read().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                key, *name = line.split(None, 1)          # (a space or a tab between)
                named.append((key, name[0].strip() if name else ""))
        if len(named) == before:    # (a key file that holds none left the server open)
            raise ValueError(f"the API key file {path} holds no keys: a line is a key, "
                             "then optionally its name")
    seen: set[str] = set()
    for key, _ in named:
        if key in seen:     # (one client counted as two tenants: half the queue, its usage
            raise ValueError(f"the API key with fingerprint {key_fingerprint(key)} is "
                             "given twice (flags, variable or key file)")     # split)
        seen.add(key)
    return [(key.encode(), name or f"key-{key_fingerprint(key)}") for key, name in named]


def key_fingerprint(key: str) -> str:
    """A key's short fingerprint (the first 8 hex digits of its SHA-256): the same on
    every part, and it tells nothing of the key."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:8]
