from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving.server import Server


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


def running(logs: Path, **settings: object) -> Iterator[Server]:
    server = Server(logs, **settings).wait_ready()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny(tiny_repo: Path, logs: Path) -> Iterator[Server]:
    yield from running(logs, model_repository=tiny_repo, default_model="tiny", max_inputs=8, max_chars=2000,
                       max_body_bytes=20000, max_explain_elements=5000, max_wait_ms=20)
