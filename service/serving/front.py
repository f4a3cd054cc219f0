"""A front of several (``ROUTING_WORKERS`` > 1), as the supervisor starts it: ``python -m service.serving.front K
HOST-SOCKET FD``, the server's settings as JSON on standard input. It serves the app over the engine host at
HOST-SOCKET (:class:`~service.serving.remote.client.RemoteEngine`), accepting HTTP from the listening socket FD that
every front shares (see :mod:`service.serving.supervisor`)."""

from __future__ import annotations

import sys
from pathlib import Path

from service.config import Settings
from service.serving.server import run_front


def main(argv: list[str]) -> int:
    return run_front(Settings.model_validate_json(sys.stdin.read()), int(argv[0]), Path(argv[1]), int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
