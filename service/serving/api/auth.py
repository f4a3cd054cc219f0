"""API keys (``ROUTING_API_KEYS``) and admin keys (``ROUTING_ADMIN_KEYS``), as every protocol checks them: a bearer
token compared in constant time with every configured key. The HTTP routes read it from the ``Authorization`` header,
the gRPC service from the call's metadata."""

from __future__ import annotations

import hmac

from service.serving.core.errors import APIError
from service.serving.state import AppState


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
