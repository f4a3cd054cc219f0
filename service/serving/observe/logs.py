"""Log lines: plain text, or one JSON object per line (``ROUTING_LOG_JSON``) with each record's fields; the same
in the backbones' processes, which are told how (a :class:`LogSetup`). A log holds log
lines only: Python warnings become records, and the progress bars libraries draw (transformers, loading weights)
are off."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.config import Settings, unknown_variables

log = logging.getLogger("service.config")


@dataclass(frozen=True)
class LogSetup:
    """How a process of the server logs: one JSON object per line or plain lines, and from which level (the server
    sends its own to each backbone process; see this module)."""

    json_lines: bool = False
    level: str = "info"


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


_current = LogSetup()  # this process's, once configured


def setup_logging(settings: Settings) -> None:
    configure(LogSetup(settings.log_json, settings.log_level))


def configure(setup: LogSetup) -> None:
    """Log to stderr as ``setup`` says (before transformers is imported, for its progress bars to stay off)."""
    global _current
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by huggingface_hub, and transformers' tqdm
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if setup.json_lines else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(setup.level.upper())
    logging.captureWarnings(True)
    _current = setup


def warn_unknown_variables(environ: Mapping[str, str] = os.environ) -> None:
    """A warning for each ``ROUTING_*`` variable that names no setting (see :func:`unknown_variables`)."""
    for var, like in sorted(unknown_variables(environ).items()):
        log.warning("%s is not a setting of the service and is ignored%s", var,
                    f" (did you mean {like}?)" if like else "")


def current() -> LogSetup:
    """How this process logs (the default when nothing configured it: plain lines)."""
    return _current
