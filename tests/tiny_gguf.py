"""The tests' tiny GGUF model (random weights, one layer, FIM tokens): the `tiny` shape
of `workers.synthetic_model`. Generated at test time, never committed."""
from __future__ import annotations

from pathlib import Path

from workers.synthetic_model import SHAPES, write_model


def write_tiny_fim_model(path: Path, seed: int = 0, repo: bool = False) -> Path:
    return write_model(path, SHAPES["tiny"], seed, repo, name="tiny-fim-test")
