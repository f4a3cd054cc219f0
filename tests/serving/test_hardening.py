"""What hostile traffic, shutdown under load and damaged models must not break (issue 12), over
HTTP against real servers; raw sockets send what well-behaved clients never would."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from service.bench.server import descendants, process_state
from tests.conftest import write_tiny_model
from tests.serving.server import Server, in_flight, metric, running


@pytest.fixture(scope="module")
def guarded(tiny_repo: Path, logs: Path) -> Iterator[Server]:
    """The tiny model with tight HTTP limits, the access log off (the default), and a misspelt setting
    (``ROUTING_MAX_BATCHSIZE``) that it ignores."""
    yield from running(logs, model_repository=tiny_repo, default_model="tiny", max_body_bytes=20000,
                       body_timeout_s=1, header_timeout_s=1, max_headers=50, max_header_bytes=8192, max_batchsize=4)


def raw(server: Server, data: bytes, wait_s: float = 5.0, pause_s: float = 0.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` (after an optional pause), read until the server closes; status, headers, body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as s:
        if pause_s:
            time.sleep(pause_s)
        if data:
            s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0] else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def assert_json_error(status: int, headers: dict[str, str], body: bytes, expected: int, code: str) -> None:
    assert status == expected, (status, headers, body[:300])
    assert headers["content-type"] == "application/json" and len(headers["x-request-id"]) == 32
    assert json.loads(body)["error"]["code"] == code


def test_chunked_body_over_the_limit_is_413(guarded: Server) -> None:
    body = json.dumps({"inputs": ["z" * 30000]}).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: the body is streamed in chunks
        for k in range(0, len(body), 4096):
            yield body[k : k + 4096]

    r = httpx.post(f"{guarded.url}/v1/classify", content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["code"] == "payload_too_large" and "x-request-id" in r.headers
    small = json.dumps({"inputs": ["a chunked body under the limit"]}).encode()
    ok = httpx.post(f"{guarded.url}/v1/classify", content=iter([small[:10], small[10:]]),
                    headers={"Content-Type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_a_body_that_does_not_arrive_in_time_is_408(guarded: Server) -> None:
    head = (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    t0 = time.monotonic()
    status, headers, body = raw(guarded, head + b'{"inputs": ["slo')  # 16 of the 100 bytes, then silence
    assert_json_error(status, headers, body, 408, "request_timeout")
    assert time.monotonic() - t0 < 4


def test_idle_and_trickling_connections_are_closed_with_408(guarded: Server) -> None:
    t0 = time.monotonic()
    status, headers, body = raw(guarded, b"")  # connect and send nothing
    assert_json_error(status, headers, body, 408, "request_timeout")
    status, headers, body = raw(guarded, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    assert_json_error(status, headers, body, 408, "request_timeout")
    assert time.monotonic() - t0 < 6
    assert httpx.get(f"{guarded.url}/healthz").status_code == 200  # well-behaved clients are unaffected


@pytest.mark.parametrize("head", [
    b"X-Big: " + b"a" * 1_000_000 + b"\r\n",
    b"".join(b"X-H%d: v\r\n" % k for k in range(10_000)),
])
def test_too_many_or_too_large_headers_are_431(guarded: Server, head: bytes) -> None:
    status, headers, body = raw(guarded, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
    assert_json_error(status, headers, body, 431, "request_header_fields_too_large")


@pytest.mark.parametrize("request_", [
    b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    "GET /healthz?q=\u00e9t\u00e9 HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
    b"NOT HTTP AT ALL\r\n\r\n",
])
def test_requests_the_parser_rejects_get_json_400(guarded: Server, request_: bytes) -> None:
    status, headers, body = raw(guarded, request_)
    assert_json_error(status, headers, body, 400, "bad_request")


DRAIN = 3


def test_drain_deadline_answers_every_request_in_json_and_exits_in_time(tiny_repo: Path, logs: Path) -> None:
    """More queued work than the drain timeout: results for what was computed, 503 for the rest."""
    server = Server(logs, model_repository=tiny_repo, default_model="tiny", max_batch_size=1, max_wait_ms=0,
                    drain_timeout_s=DRAIN, max_chars=20000).wait_ready()
    text = "a long text that needs a great many chunks of the tiny backbone, " * 300
    answers: list[tuple[int, str, str | None]] = []

    def record(r: httpx.Response | httpx.TransportError) -> None:
        if isinstance(r, httpx.Response):
            answers.append((r.status_code, r.headers.get("content-type", ""), r.headers.get("retry-after")))
        else:
            answers.append((0, type(r).__name__, None))

    thread = in_flight(server, [{"inputs": [text] * 8}] * 20, record)
    time.sleep(0.5)
    t0 = time.monotonic()
    server.terminate()
    code = server.proc.wait(30)
    exited = time.monotonic() - t0
    thread.join(30)
    log = server.log()
    server.stop()
    assert len(answers) == 20
    assert all(ctype == "application/json" for _, ctype, _ in answers), answers
    codes = [status for status, _, _ in answers]
    assert set(codes) <= {200, 503} and codes.count(503) >= 1, codes  # the work did not fit in the drain
    assert all(retry for status, _, retry in answers if status == 503), answers
    assert code == 0, log
    # the drain, then at most the batch computing at the deadline and a short grace: the old code waited
    # the drain timeout three times over (drain, uvicorn's graceful shutdown, the batcher stop)
    assert exited < DRAIN + 5, f"exited {exited:.1f} s after SIGTERM with a {DRAIN} s drain timeout"
    assert "drain deadline passed" in log


def write_head(folder: Path, change: dict[str, float]) -> None:
    """Overwrite some tensors of a model folder's head weights with a constant."""
    path = folder / "head.safetensors"
    state = load_file(str(path))
    for name, value in change.items():
        state[name] = torch.full_like(state[name], value)
    save_file(state, str(path))


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path) -> Path:
    """A model whose weights are finite but whose scores overflow to Inf/NaN."""
    repo = tmp_path_factory.mktemp("overflow")
    folder = write_tiny_model(repo, tiny_backbone_dir, name="overflow")
    write_head(folder, {"route.2.W_F1": 1e30, "route.2.W_F2": 1e30})
    return repo


def test_non_finite_scores_fail_the_warm_up(overflowing: Path, logs: Path) -> None:
    server = Server(logs, model_repository=overflowing, default_model="overflow")
    assert server.proc.wait(120) == 1
    log = server.log()
    server.stop()
    assert "model loading failed" in log and "non-finite scores" in log and "warm-up" in log


def test_non_finite_scores_at_run_time_are_500_and_counted(overflowing: Path, logs: Path) -> None:
    for server in running(logs, model_repository=overflowing, default_model="overflow", warmup="false"):
        r = httpx.post(f"{server.url}/v1/classify", json={"inputs": ["hello"]}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        assert "non-finite" in r.json()["error"]["message"]
        page = httpx.get(f"{server.url}/metrics").text
        assert metric(page, "routing_failures_total", reason="internal") == 1
        assert metric(page, "routing_requests_total", status="500") == 1


def test_an_unknown_hub_backbone_fails_within_seconds(tiny_repo: Path, logs: Path, tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path, Path("someone/no-such-backbone"), name="hub")
    t0 = time.monotonic()
    server = Server(logs, model_repository=tmp_path, default_model="hub")  # the harness sets HF_HUB_OFFLINE=1
    assert server.proc.wait(60) == 1
    log = server.log()
    server.stop()
    assert time.monotonic() - t0 < 20 and "someone/no-such-backbone" in log and "not in the local cache" in log
    assert folder.is_dir()


def test_a_port_in_use_fails_at_once_before_any_model_loads(tiny_repo: Path, logs: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        server = Server(logs, model_repository=tiny_repo, port=port)
        assert server.proc.wait(60) == 3
        log = server.log()
        server.stop()
    assert time.monotonic() - t0 < 20
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use (another server listens there;" in log, log
    assert "loading models" not in log and "computes in" not in log  # nothing was loaded


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_while_the_models_load_stops_their_process_and_exits_0(tiny_repo: Path, logs: Path,
                                                                        workers: int) -> None:
    """With two fronts, the signal reaches the supervisor, which stops the engine host while it loads."""
    server = Server(logs, model_repository=tiny_repo, default_model="tiny", workers=workers)
    end = time.monotonic() + 60
    while "loading models" not in server.full_log() and time.monotonic() < end:
        time.sleep(0.02)
    loading = descendants(server.proc.pid)  # the backbone's process, importing torch (or about to start); the host
    t0 = time.monotonic()
    server.terminate()
    code = server.proc.wait(30)
    exited = time.monotonic() - t0
    log = server.log()
    server.stop()
    assert code == 0, log  # shutting down while loading is no failure
    assert "computes in process" not in log and "model loading failed" not in log, log  # stopped, not waited for
    assert exited < 5, f"exited {exited:.1f} s after SIGTERM"
    assert not [pid for pid in loading if process_state(pid) not in (None, "Z")]  # nothing left running


def test_json_logs_hold_json_lines_only(tiny_repo: Path, logs: Path) -> None:
    """ROUTING_LOG_JSON: every line a JSON object, from the server's process and the backbone's (transformers drew
    its 'Loading weights' progress bar there, and Python's warnings printed as they are)."""
    for server in running(logs, model_repository=tiny_repo, default_model="tiny", log_json=True):
        assert httpx.post(f"{server.url}/v1/classify", json={"inputs": ["a text"]}).status_code == 200
        lines = server.full_log().splitlines()
    assert any(json.loads(line)["logger"] == "service.process" for line in lines if line.startswith("{"))
    assert [line for line in lines if not line.startswith("{")] == []
    assert all(json.loads(line)["message"] for line in lines)


def test_answers_on_a_kept_alive_connection_and_100_continue_before_the_body(guarded: Server) -> None:
    """Answers whole on one kept-alive connection (the head goes out with the body: see test_http11); a client that
    asks ``Expect: 100-continue`` gets the interim response before it sends its body, then the answer."""
    body = json.dumps({"inputs": ["one write"]}).encode()
    request = (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:
        for _ in range(3):
            s.sendall(request)
            got = s.recv(65536)
            head, _, answer = got.partition(b"\r\n\r\n")
            length = int(next(v for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])
                              if k.strip().lower() == b"content-length"))
            assert head.startswith(b"HTTP/1.1 200 ") and len(answer) == length, got
            assert json.loads(answer)["results"][0]["label"] in ("alpha", "beta", "gamma")
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_misspelt_setting_is_named_in_a_warning_at_start(guarded: Server) -> None:
    """The settings ignore a ROUTING_* variable that names none of them; the server says so, with the likely one."""
    assert "WARNING service.config: ROUTING_MAX_BATCHSIZE is not a setting of the service and is ignored (did you " \
           "mean ROUTING_MAX_BATCH_SIZE?)" in guarded.full_log()


def test_requests_answered_well_are_not_logged_by_default(guarded: Server) -> None:
    """A request answered with an error always has its log line; one answered well only with ROUTING_ACCESS_LOG
    (it is counted in the metrics either way); the probes never."""
    access_logged(guarded, False)


def test_requests_answered_well_are_logged_with_the_access_log(tiny_repo: Path, logs: Path) -> None:
    for server in running(logs, model_repository=tiny_repo, default_model="tiny", access_log=True):
        access_logged(server, True)


def access_logged(server: Server, access_log: bool) -> None:
    """One request answered well, one refused (422) and a probe: what ``server``'s log and /metrics hold of them."""
    before = metric(httpx.get(f"{server.url}/metrics").text, "routing_requests_total", endpoint="/v1/classify",
                    status="200")
    assert httpx.post(f"{server.url}/v1/classify", json={"inputs": ["a text"]}).status_code == 200
    assert httpx.post(f"{server.url}/v1/classify", json={"inputs": []},
                      headers={"X-Request-ID": "mine-1"}).status_code == 422
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    page = httpx.get(f"{server.url}/metrics").text
    time.sleep(0.2)
    lines = server.full_log().splitlines()
    assert any("POST /v1/classify 422" in line and "(request mine-1)" in line for line in lines)  # plain lines too
    assert any("POST /v1/classify 200" in line for line in lines) == access_log
    assert not any("GET /healthz" in line for line in lines)
    assert metric(page, "routing_requests_total", endpoint="/v1/classify", status="200") == before + 1
