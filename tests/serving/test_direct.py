"""The classify routes served without the framework's routing (service.serving.api.direct): a request that passes
the route's checks gets what the framework would answer, byte for byte; every other goes to the framework."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRouter
from fastapi.testclient import TestClient

from service.config import Settings
from service.serving.api import direct
from service.serving.api.app import create_app
from tests.serving.server import metric

KEY = {"Authorization": "Bearer k1"}
REQUESTS: list[tuple[str, dict[str, Any] | bytes, dict[str, str], bool]] = [  # path, body, headers, served directly
    ("/v1/classify", {"inputs": ["a fine text", "and another one"]}, KEY, True),
    ("/v1/models/tiny/classify", {"inputs": ["a fine text"], "explain": True, "method": "shares"}, KEY, True),
    ("/v1/classify", {"inputs": ["a fine text"], "models": ["tiny", "tiny-b"], "timeout_s": 30.0}, KEY, True),
    ("/v1/models/nope/classify", {"inputs": ["a fine text"]}, KEY, True),  # 404 from the pipeline
    ("/v1/classify", {"inputs": ["a fine text"], "models": "all", "explain": True}, KEY, True),
    ("/v1/classify", {"inputs": []}, KEY, False),  # the framework's 422 for an invalid body
    ("/v1/classify", {"inputs": ["a"], "extra": 1}, KEY, False),
    ("/v1/classify", b'{"inputs": ["not json"', KEY, False),
    ("/v1/classify", b"\xff\xfe", KEY, False),
    ("/v1/classify", {"inputs": ["a fine text"]}, {}, False),  # no key: 401
    ("/v1/classify", {"inputs": ["a fine text"]}, {"Authorization": "Bearer nope"}, False),
    ("/v1/models//classify", {"inputs": ["a fine text"]}, KEY, False),
    ("/v1/models/a/b/classify", {"inputs": ["a fine text"]}, KEY, False),
    ("/v1/classify", b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", KEY, False),  # past Python's recursion limit
]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    from tests.conftest import write_tiny_model

    repo = tmp_path_factory.mktemp("direct")
    write_tiny_model(repo, tiny_backbone_dir)
    write_tiny_model(repo, tiny_backbone_dir, name="tiny-b", seed=1)
    return repo


def answers(repo: Path) -> list[tuple[int, bytes, dict[str, str], bool]]:
    """Each of REQUESTS answered by an app, with whether the framework's router saw it; then its /metrics page."""
    settings = Settings(model_repository=repo, default_model="tiny", model_process=False, api_keys=["k1"],
                        grpc_port=0, max_wait_ms=0)
    app = create_app(settings)
    out = []
    with TestClient(app) as client:
        for _ in range(600):  # the models load in the background
            if client.get("/readyz").status_code == 200:
                break
            time.sleep(0.05)
        for path, body, headers, _ in REQUESTS:
            SEEN.clear()
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = client.post(path, headers={"Content-Type": "application/json", **headers}, **kwargs)
            r.headers.pop("x-request-id")
            out.append((r.status_code, r.content, dict(r.headers), bool(SEEN)))
        out.append((0, client.get("/metrics").content, {}, False))
    return out


SEEN: list[str] = []


def test_the_direct_routes_answer_as_the_framework_and_hand_on_the_rest(repo: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    router = APIRouter.__call__

    async def spy(self: APIRouter, scope: Any, receive: Any, send: Any) -> None:
        SEEN.append(scope.get("path", ""))
        await router(self, scope, receive, send)

    monkeypatch.setattr(APIRouter, "__call__", spy)
    served = answers(repo)

    async def hand_on(self: direct.DirectRoutes, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)

    monkeypatch.setattr(direct.DirectRoutes, "__call__", hand_on)
    framework = answers(repo)
    for (path, body, _, is_direct), got, want in zip(REQUESTS, served, framework, strict=False):
        assert got[:3] == want[:3], (path, body, got[:2], want[:2])  # status, bytes, headers
        assert got[3] is not is_direct, (path, body)  # the framework's router saw it, or not
        assert want[3]  # without the direct routes it sees everything
    assert served[0][0] == 200 and served[3][0] == 404 and served[5][0] == 422 and served[9][0] == 401
    assert served[len(REQUESTS) - 1][0] == 422  # nested past the recursion limit: the framework's 422 (it was a 500)
    page = served[-1][1].decode()
    assert metric(page, "routing_requests_total", endpoint="/v1/classify", status="200") == 3
    assert metric(page, "routing_requests_total", endpoint="/v1/models/{model}/classify", status="404") == 1
