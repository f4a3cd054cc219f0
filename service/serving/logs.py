"""Log lines: plain text, or one JSON object per line (``ROUTING_LOG_JSON``) with each record's fields."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from service.config import Settings


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if settings.log_json else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
