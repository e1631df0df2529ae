"""Structured logging for semkv (structlog), with a guard that keeps payloads out of logs.

NOTE: semkv never logs prompt text, token ids or embeddings. ``redact_payloads`` enforces it
for every event that goes through ``get_logger``: known payload keys are replaced by their
size, and any long sequence or long string value is replaced by its length, whatever its key.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import structlog

PAYLOAD_KEYS = frozenset(
    {"prompt", "text", "texts", "token_ids", "tokens", "prompt_token_ids", "embedding",
     "embeddings", "vector", "output", "completion"}
)
MAX_STRING = 96  # identifiers and reasons are short; anything longer is treated as payload
MAX_SEQUENCE = 8


def _size(value: Any) -> str:
    try:
        return f"<redacted len={len(value)}>"
    except TypeError:
        return "<redacted>"


def redact_payloads(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> Mapping[str, Any]:
    for key, value in list(event_dict.items()):
        if key == "event":
            continue
        if key in PAYLOAD_KEYS:
            event_dict[key] = _size(value)
        elif isinstance(value, str) and len(value) > MAX_STRING:
            event_dict[key] = _size(value)
        elif isinstance(value, (bytes, bytearray)) or (
            isinstance(value, Sequence) and not isinstance(value, str) and len(value) > MAX_SEQUENCE
        ):
            event_dict[key] = _size(value)
    return event_dict


_configured = False


def configure(level: str | None = None) -> None:
    """Route semkv's structlog events through stdlib logging (so vLLM's handlers see them)."""
    global _configured
    root = logging.getLogger("semkv")
    root.setLevel(level or os.environ.get("SEMKV_LOG_LEVEL", "INFO"))
    if not root.handlers:  # engines configure their own loggers only; give semkv's a home
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        root.addHandler(handler)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.add_log_level,
            redact_payloads,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(name: str) -> Any:
    if not _configured:
        configure()
    return structlog.get_logger(name)


class Throttle:
    """At most one line per key every ``every_s`` seconds (an outage fails every call: its
    warnings must not flood the log). ``allow(key)`` is None while a line is held back, else
    how many were held back since the last one (the line should say so)."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[object, float] = {}
        self._held: dict[object, int] = {}
        self._lock = threading.Lock()

    def allow(self, key: object) -> int | None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every_s:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)
