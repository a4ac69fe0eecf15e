"""A GGUF file's metadata, read from its header without llama.cpp.

A worker needs a few of the model's sizes before it loads it (the memory check,
`backends.check_placement`). llama.cpp's vocabulary-only load gives them but builds the
whole tokenizer first: 0.7 s of one core for Gemma 3's 262k tokens, at every start and
again in the real load. The header holds them as plain key-value pairs (GGUF versions 2
and 3, little-endian: the layout llama.cpp's gguf.cpp reads). Anything this reader does
not expect (another version, a nested array, a truncated file, sizes past the bounds
below) is a GGUFHeaderError, and the caller asks llama.cpp instead.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# value types (gguf_type) of a fixed size, by their struct format
FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
         12: "d"}
STRING, ARRAY = 8, 9
MAX_PAIRS = 1 << 16         # key-value pairs: a real model has a few dozen
MAX_STRING = 1 << 24        # bytes of one string (a chat template is a few KiB)
MAX_STRINGS = 1 << 23       # strings in the header's arrays, all together (a vocabulary
                            # is up to ~10^6: past this, walking them would take seconds)
KEEP_VALUES = 4096          # an array's numbers are kept up to this many (per-layer sizes);
                            # a longer one (a vocabulary's scores) is counted and skipped


class GGUFHeaderError(ValueError):
    """The header is not one this reader knows: ask llama.cpp."""


@dataclass(frozen=True)
class Array:
    """An array value: its length, and its numbers where there are at most KEEP_VALUES
    (None for strings and longer arrays)."""
    count: int
    values: tuple | None = None


def read_metadata(path: str) -> dict[str, object]:
    """Every key-value pair of the file's header: numbers, booleans and strings as they
    are, arrays as `Array`."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Reader(data).pairs()
    except (OSError, ValueError, OverflowError, struct.error) as exc:
        if isinstance(exc, GGUFHeaderError):
            raise
        raise GGUFHeaderError(f"cannot read the GGUF header of {path}: {exc}") from None


class _Reader:
    def __init__(self, data) -> None:
        self.data, self.at = data, 0
        self.strings = 0            # array elements that were strings, so far

    def pairs(self) -> dict[str, object]:
        if self.data[:4] != MAGIC:
            raise GGUFHeaderError("not a GGUF file")
        self.at = 4
        (version,) = self.unpack("<I")
        if version not in VERSIONS:
            raise GGUFHeaderError(f"GGUF version {version}")
        _tensors, count = self.unpack("<QQ")
        if count > MAX_PAIRS:
            raise GGUFHeaderError(f"{count} key-value pairs")
        found: dict[str, object] = {}
        for _ in range(count):
            key = self.string()
            (kind,) = self.unpack("<I")
            found[key] = self.array() if kind == ARRAY else self.value(kind)
        return found

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (size,) = self.unpack("<Q")
        if size > MAX_STRING or self.at + size > len(self.data):
            raise GGUFHeaderError(f"a string of {size} bytes")
        text = bytes(self.data[self.at:self.at + size]).decode("utf-8", "replace")
        self.at += size
        return text

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind not in FIXED:
            raise GGUFHeaderError(f"value type {kind}")
        return self.unpack("<" + FIXED[kind])[0]

    def array(self) -> Array:
        kind, count = self.unpack("<IQ")
        if kind == STRING:
            end = len(self.data)
            if count > (end - self.at) // 8:        # (each at least its length's 8 bytes)
                raise GGUFHeaderError(f"an array of {count} strings past the end of the file")
            self.strings += count
            if self.strings > MAX_STRINGS:
                raise GGUFHeaderError(f"more than {MAX_STRINGS} strings in arrays")
            for _ in range(count):                  # (each string's length, then its bytes)
                (size,) = struct.unpack_from("<Q", self.data, self.at)
                if size > end - self.at - 8:
                    raise GGUFHeaderError("an array of strings past the end of the file")
                self.at += 8 + size
            return Array(count)
        if kind not in FIXED:
            raise GGUFHeaderError(f"an array of type {kind}")
        fmt = FIXED[kind]
        size = count * struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GGUFHeaderError(f"an array of {count} values past the end of the file")
        values = struct.unpack_from(f"<{count}{fmt}", self.data, self.at) \
            if count <= KEEP_VALUES else None
        self.at += size
        return Array(count, values)
