"""Every part's log in one of two formats (`--log-format`): `text`, a line of time,
level, logger and process id, then the message; or `json`, one object per line with
`time`, `level`, `part` (dispatcher, worker, frontend, access, llama.cpp), `worker` where
the line is a worker's, `request_id` where the line names one, `logger` and `message`.
Neither carries request content: the messages never do (docs/failures-and-limits.md).
"""
from __future__ import annotations

import json
import logging
import re
import sys
from datetime import datetime, timezone

from dispatcher.common.config import LOG_FORMAT

REQUEST_ID = re.compile(r"\b(cmpl-[0-9A-Za-z]+(?:\.\d+)*)")


def timestamp(seconds: float | None = None) -> str:
    moment = datetime.now(timezone.utc) if seconds is None else \
        datetime.fromtimestamp(seconds, timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    def __init__(self, part: str, worker: str | None = None):
        super().__init__()
        self.part, self.worker = part, worker

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out = {"time": timestamp(record.created), "level": record.levelname.lower(),
               "part": self.part}
        if self.worker:
            out["worker"] = self.worker
        request_id = getattr(record, "request_id", None)
        if request_id is None and (found := REQUEST_ID.search(message)):
            request_id = found.group(1)
        if request_id:
            out["request_id"] = request_id
        out["logger"] = record.name
        out["message"] = message
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return one_line_json(out)


def formatter(log_format: str, part: str, worker: str | None = None) -> logging.Formatter:
    return JsonFormatter(part, worker) if log_format == "json" else \
        logging.Formatter(LOG_FORMAT)


def setup(level: str, log_format: str, part: str, worker: str | None = None) -> None:
    """The process's root logger: `level`, to stderr, in `log_format`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format, part, worker))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def name_worker(worker: str) -> None:
    """A worker's lines say its name once it is known (after its model is loaded)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            handler.formatter.worker = worker


def json_line(part: str, level: str, message: str, worker: str | None = None) -> str:
    """A line of another source (llama.cpp's own log) in the json format."""
    out = {"time": timestamp(), "level": level, "part": part}
    if worker:
        out["worker"] = worker
    out["message"] = message
    return one_line_json(out) + "\n"


# characters json.dumps leaves raw that some readers split lines at (Python's
# str.splitlines, log viewers): NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line_json(value) -> str:
    """`value` as JSON on one line for every reader: other text as it is (not \\u
    escapes), but the characters some split lines at escaped (a client's User-Agent or
    path carrying U+2028 broke a record in two)."""
    return json.dumps(value, ensure_ascii=False).translate(_LINE_BREAKS)
