"""Log lines as JSON, each carrying the request id and transfer id it concerns (``log_format: json``).

* :func:`bind` puts ``request_id`` / ``transfer_id`` into the current context (an asyncio
  task in the router, a thread in a connector); :class:`ContextFilter` copies them onto every
  record logged in that context, and :class:`JsonFormatter` writes one JSON object per line:
  ``{"ts", "level", "logger", "pid", "msg", "request_id", "transfer_id"[, "exc"]}``.
* :func:`setup` configures a kvrelay process (router, ``kvrelay serve``'s supervisor).
* :func:`vllm_logging_config` writes the ``dictConfig`` file vLLM reads from
  ``VLLM_LOGGING_CONFIG_PATH`` (``kvrelay serve`` sets it), so the engine processes - vLLM's
  own lines and the connectors' - log the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvrelay.common.private_files import write_atomic

_REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvrelay_request_id", default=None)
_TRANSFER: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvrelay_transfer_id", default=None)


class LogFormat(str, enum.Enum):
    TEXT = "text"
    JSON = "json"


@contextlib.contextmanager
def bind(request_id: str | None = None, transfer_id: str | None = None) -> Iterator[None]:
    """Within the block, records logged in this context carry these ids."""
    tokens = [(var, var.set(value)) for var, value in ((_REQUEST, request_id), (_TRANSFER, transfer_id))
              if value is not None]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def set_ids(request_id: str | None = None, transfer_id: str | None = None) -> None:
    """Set the ids for the rest of this context (an asyncio task's handler, a worker thread's job)."""
    if request_id is not None:
        _REQUEST.set(request_id)
    if transfer_id is not None:
        _TRANSFER.set(transfer_id)


class ContextFilter(logging.Filter):
    """Adds ``request_id`` / ``transfer_id`` from the context unless the call passed them in ``extra``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _REQUEST.get()
        if getattr(record, "transfer_id", None) is None:
            record.transfer_id = _TRANSFER.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "pid": record.process, "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", None), "transfer_id": getattr(record, "transfer_id", None)}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup(fmt: LogFormat, level: int = logging.INFO) -> None:
    """Configure this process's root logger: ``text`` (timestamped lines) or ``json``."""
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt is LogFormat.JSON
                         else logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def vllm_logging_config(path: str | os.PathLike[str]) -> str:
    """Write a vLLM ``VLLM_LOGGING_CONFIG_PATH`` file that logs JSON lines to stdout; its path."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "filters": ["ids"],
               "stream": "ext://sys.stdout"}
    config = {"version": 1, "disable_existing_loggers": False,
              "filters": {"ids": {"()": "kvrelay.core.logs.ContextFilter"}},
              "formatters": {"json": {"()": "kvrelay.core.logs.JsonFormatter"}},
              "handlers": {"json": handler},
              "loggers": {name: {"handlers": ["json"], "level": "INFO", "propagate": False}
                          for name in ("vllm", "uvicorn", "uvicorn.error", "kvrelay")},
              "root": {"handlers": ["json"], "level": "WARNING"}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(config, indent=1).encode())
    return str(path)
