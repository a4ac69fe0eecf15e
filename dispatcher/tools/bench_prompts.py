"""Code prompts of a given size for `python -m dispatcher bench --constrained` (a ratio
of two figures on the same prompts; the workloads' first-seen prompts are
bench_corpus.py's)."""
from __future__ import annotations


CODE = '''import json
import os


class Inventory:
    """Items in stock, persisted as JSON."""

    def __init__(self, path):
        self.path = path
        self.items = {}
        if os.path.exists(path):
            with open(path) as f:
                self.items = json.load(f)

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count
        self.save()

    def remove(self, name, count=1):
        left = self.items.get(name, 0) - count
        if left <= 0:
            self.items.pop(name, None)
        else:
            self.items[name] = left
        self.save()

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.items, f, indent=2)

    def total(self):
'''


def prompt_of(chars: int, salt: int = 0) -> str:
    """A code prompt of about `chars` characters; `salt` makes prompts differ at the start
    so that no request reuses another's cached prefix unless the workload wants it."""
    text = f"# file {salt}\n" + CODE
    while len(text) < chars:
        text += CODE
    return text[:chars]
