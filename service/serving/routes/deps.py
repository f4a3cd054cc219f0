"""Dependencies shared by the route modules: app state, API-key and content-type checks.

The dependencies are ``async def``: they do no blocking work, and FastAPI runs a plain ``def``
dependency in its thread pool, a thread hop per dependency and request."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from service.serving.errors import APIError
from service.serving.state import AppState


async def get_state(request: Request) -> AppState:
    return request.app.state.app_state


State = Annotated[AppState, Depends(get_state)]


def _bearer_in(keys: list[str], authorization: str | None) -> bool:
    """Whether ``Authorization: Bearer <key>`` names one of ``keys`` (constant-time comparison)."""
    scheme, _, token = (authorization or "").partition(" ")
    ok = False
    for key in keys:  # compare with every key so timing says nothing about which matched
        ok |= hmac.compare_digest(token.strip().encode(), key.encode())
    return scheme.lower() == "bearer" and ok


def check_key(state: AppState, authorization: str | None) -> None:
    """401 unless ``Authorization: Bearer <key>`` names a configured API key (none configured: open)."""
    keys = state.settings.api_keys
    if keys and not _bearer_in(keys, authorization):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       headers={"WWW-Authenticate": "Bearer"})


async def require_admin(request: Request) -> None:
    """401 unless the request carries an admin key (see :func:`check_admin`)."""
    check_admin(await get_state(request), request.headers.get("authorization"))


def check_admin(state: AppState, authorization: str | None) -> None:
    """401 unless ``authorization`` carries an admin key (``ROUTING_ADMIN_KEYS``); 403 with an inference key, or
    when no admin key is configured (model control is then closed to every client)."""
    settings = state.settings
    if not settings.admin_keys:
        raise APIError(403, "the model repository needs an admin key, and none is configured (ROUTING_ADMIN_KEYS)")
    if _bearer_in(settings.admin_keys, authorization):
        return
    if _bearer_in(settings.api_keys, authorization):
        raise APIError(403, "an inference API key cannot control models: send an admin key")
    raise APIError(401, "missing or invalid admin key: send 'Authorization: Bearer <admin key>'",
                   headers={"WWW-Authenticate": "Bearer"})


async def require_key(request: Request) -> None:
    """401 unless the request carries a configured API key (see :func:`check_key`). The header is read
    from the request itself: a ``Header`` parameter costs FastAPI a validation pass on every request."""
    check_key(await get_state(request), request.headers.get("authorization"))


async def require_json(request: Request) -> None:
    """415 unless the body is sent as JSON."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(415, f"send the body as application/json, not {ctype or 'no content type'!r}")
