"""Dependencies shared by the route modules: the app state, API-key and content-type checks (the keys' rules are
:mod:`service.serving.api.auth`'s), and the client's going away.

The dependencies are ``async def``: they do no blocking work, and FastAPI runs a plain ``def``
dependency in its thread pool, a thread hop per dependency and request."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.serving.api.auth import check_admin, check_key
from service.serving.core.errors import APIError
from service.serving.pipeline.inference import Gone
from service.serving.state import AppState


async def get_state(request: Request) -> AppState:
    return request.app.state.app_state


State = Annotated[AppState, Depends(get_state)]


async def require_admin(request: Request) -> None:
    """401 unless the request carries an admin key (see :func:`check_admin`)."""
    check_admin(await get_state(request), request.headers.get("authorization"))


async def require_key(request: Request) -> None:
    """401 unless the request carries a configured API key (see :func:`check_key`). The header is read
    from the request itself: a ``Header`` parameter costs FastAPI a validation pass on every request."""
    check_key(await get_state(request), request.headers.get("authorization"))


def media_type(content_type: str) -> str:
    """A Content-Type header's media type, lower case, without its parameters."""
    return content_type.split(";")[0].strip().lower()


def is_json(media: str) -> bool:
    """Whether a body of ``media`` type is JSON (``application/json``, or any ``+json`` type)."""
    return media == "application/json" or media.endswith("+json")


async def require_json(request: Request) -> None:
    """415 unless the body is sent as JSON."""
    ctype = media_type(request.headers.get("content-type", ""))
    if not is_json(ctype):
        raise APIError(415, f"send the body as application/json, not {ctype or 'no content type'!r}")


def client_gone(request: Request) -> Gone:
    """What returns once the client of ``request`` has disconnected."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    return gone
