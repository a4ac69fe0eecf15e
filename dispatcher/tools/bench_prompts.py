"""The texts `python -m dispatcher bench` sends: code prompts of a given size, and the
single-stream workloads' prompts."""
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


EDIT_SOURCE = "".join(
    f"def handler_{i}(request):\n    value = request.get('field_{i}')\n"
    f"    if value is None:\n        return error('missing field_{i}')\n"
    f"    return respond(value * {i})\n\n\n" for i in range(12))


# `fresh`: new code, each prompt asked `requests` times in a row (an editor asks for
# nearly the same completion again and again). Several prompts, because whether a
# repeat drafts the earlier answer whole turns on near-ties in the greedy text that a
# draft's batched rows flip one way or the other: one prompt measures one coin.
FRESH_PROMPTS = ("def merge_sorted(left, right):\n", "class LRUCache:\n",
                 "def parse_args(argv):\n", "import os\n\ndef walk_files(root):\n",
                 "function debounce(fn, ms) {\n", "def fibonacci(n):\n")
