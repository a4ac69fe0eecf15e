"""First-seen prompts for `python -m dispatcher bench`: real source files, a different one
for every request of a run.

A server that has answered a prompt before answers it again from what it kept (its
prompt cache, the key's earlier answers as drafts): a figure measured on repeats is a
figure of the cache. So each part of the bench takes files of its own from a corpus (the
standard library of the interpreter running the bench, on every machine; or `--corpus
DIR`), shuffled by the run's seed (printed; `--seed` repeats a run's choice), and no file
serves two requests of one target. Every target of a run gets the same prompts, each the
first time it sees them. What is warm on purpose (`repeat`, `extend prompt`) says so in
its name."""
from __future__ import annotations

import ast
import os
import random
import sysconfig
from pathlib import Path

MIN_CHARS = 3000            # files smaller than this make short, odd prompts
MAX_CHARS = 200_000
CONTEXT_CHARS = 2000        # code before a function's body in `fresh` and `edit` prompts
EDIT_LINES = (6, 40)        # the lines of a function an `edit` prompt has rewritten
EDIT_CHARS = 1500           # ... and its characters at most (a prompt stays ~1,000 tokens)


class CorpusError(ValueError):
    """No usable source files where the corpus was asked for."""


def standard_library() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


# Directories left out: installed packages (the corpus is the standard library itself),
# tests (fixtures, generated data) and codec tables (a hundred near-copies of one file:
# a later request's prompt would be an earlier one's)
SKIPPED = {"site-packages", "dist-packages", "encodings", "__pycache__", "node_modules"}


def source_files(root: Path):
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories
                             if d not in SKIPPED and "test" not in d.lower()]
        for name in names:
            if name.endswith(".py"):
                yield Path(directory) / name


class Corpus:
    """Source files shuffled by `seed`, dealt out to the bench's parts: `files_for(part,
    n)` gives a part the same n texts every time it asks (every target the same
    prompts) and no two parts, nor two requests of one part, the same file."""

    def __init__(self, root: Path | None = None, seed: int | None = None):
        self.root = Path(root) if root is not None else standard_library()
        self.seed = seed if seed is not None else random.SystemRandom().randrange(10 ** 6)
        if not self.root.is_dir():
            raise CorpusError(f"{self.root} is not a directory")
        paths = sorted(source_files(self.root))
        if not paths:
            raise CorpusError(f"no Python source files under {self.root}")
        random.Random(self.seed).shuffle(paths)
        self._paths = iter(paths)
        self._dealt: dict[str, list[str]] = {}

    def _next_text(self) -> str:
        for path in self._paths:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if MIN_CHARS <= len(text) <= MAX_CHARS and "\x00" not in text:
                return text
        raise CorpusError(f"not enough Python source files of {MIN_CHARS}-{MAX_CHARS} "
                          f"characters under {self.root} for this run")

    def files_for(self, part: str, n: int, min_chars: int = 0) -> list[str]:
        """The part's n files (of at least `min_chars` characters: shorter ones are
        passed over, to no part)."""
        dealt = self._dealt.setdefault(part, [])
        while len(dealt) < n:
            text = self._next_text()
            if len(text) >= min_chars:
                dealt.append(text)
        return dealt[:n]

    def prompts(self, part: str, n: int, make, min_chars: int = 0) -> list[str]:
        """`make(text)` of each of the part's n files."""
        return [make(text) for text in self.files_for(part, n, min_chars)]


def opening(text: str, chars: int) -> str:
    """The file's first `chars` characters, cut at the end of a line."""
    cut = text.rfind("\n", 0, max(1, chars))
    return text[:cut + 1] if cut > 0 else text[:chars]


def _functions(text: str) -> list[ast.FunctionDef]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body]


def _lines_before(lines: list[str], end: int, chars: int = CONTEXT_CHARS) -> str:
    """The lines before line `end` (0-based), at most `chars` of them."""
    head, size, start = lines[:end], 0, end
    while start > 0 and size + len(head[start - 1]) <= chars:
        start -= 1
        size += len(head[start])
    return "".join(head[start:])


def function_start(text: str, context_chars: int = CONTEXT_CHARS) -> str:
    """New code to write: the file up to a function's first statement past its opening
    (its signature and docstring given, its body not), with the code before it (up to
    `context_chars`); the file's opening where it has no such function."""
    lines = text.splitlines(keepends=True)
    for node in _functions(text):
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None),
                                                      ast.Constant) and len(node.body) > 1:
            first = node.body[1]                      # (the docstring is given)
        if first.lineno - 1 > 20 and first.lineno - node.lineno < 30:
            return _lines_before(lines, first.lineno - 1, context_chars)
    return opening(text, context_chars)


def edit(text: str, context_chars: int = CONTEXT_CHARS) -> str:
    """A function rewritten with one change: the code before it (up to `context_chars`)
    and the function, then its first line again under a new name; the rest of the
    rewrite is the model's (a copy of the body that drafts from the prompt can find)."""
    lines = text.splitlines(keepends=True)
    for node in _functions(text):
        span = node.end_lineno - node.lineno + 1
        if not EDIT_LINES[0] <= span <= EDIT_LINES[1] or node.decorator_list:
            continue
        first = lines[node.lineno - 1]
        if f"def {node.name}(" not in first:
            continue
        body = "".join(lines[node.lineno - 1:node.end_lineno])
        if len(body) > EDIT_CHARS:
            continue
        renamed = first.replace(f"def {node.name}(", f"def {node.name}_v2(", 1)
        return _lines_before(lines, node.lineno - 1, context_chars) + body + "\n" + renamed
    return function_start(text, context_chars)
