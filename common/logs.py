"""Logging set-up at the edge: readable lines by default, JSON lines with `--log-json`.

Code logs request-scoped messages with `extra={"request_id": ...}`; both formats show it.
"""

from __future__ import annotations

import json
import logging
import time


class _RequestIdDefault(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = None
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if getattr(record, "request_id", None):
            entry["request_id"] = record.request_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [request_id={rid}]" if rid else line


def setup_logging(level: int = logging.INFO, json_lines: bool = False) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdDefault())
    handler.setFormatter(JsonFormatter() if json_lines else
                         TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # one line per request otherwise
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))
