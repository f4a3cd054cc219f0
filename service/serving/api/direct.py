"""The hottest routes without the framework's routing: ``POST /v1/classify`` and ``POST /v1/models/{model}/classify``
(a text classified, no credit: most requests a server answers).

A request for one of them is checked here as the route's dependencies check it (a JSON content type, an API key
where keys are set) and its body validated by the route's own model, as the framework would (``json.loads``, then
the model in Python mode); then the route's own endpoint is called with them, and an
:class:`~service.serving.core.errors.APIError` it raises is answered by the app's own handler. Whatever does not
pass goes to the framework untouched (its body given again), which answers it exactly as it always has: the error
bodies, ``/openapi.json`` and the metrics' endpoint labels are the framework's. What this saves is the routing
through every route, the dependency resolution and the framework's exception middlewares (about a tenth of the
front's time a request, profiled at c = 32)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from service.serving.api.auth import check_key
from service.serving.api.errors import api_error
from service.serving.api.middleware import given_first
from service.serving.api.routes import inference
from service.serving.api.routes.deps import is_json, media_type
from service.serving.api.schemas import ClassifyRequest
from service.serving.core.errors import APIError

DEFAULT, NAMED = "/v1/classify", "/v1/models/{model}/classify"
PREFIX, SUFFIX = "/v1/models/", "/classify"


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """A request header's value as the framework reads it (latin-1), None when absent."""
    return next((v.decode("latin-1") for k, v in headers if k == name), None)


class DirectRoutes:
    """ASGI middleware in front of the framework's router (inside the body guard: the whole body comes in one
    message) that serves the classify routes' requests that pass, and hands every other request on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._routes = {r.path: r for r in inference.router.routes  # path -> the route the framework would take
                        if isinstance(r, APIRoute) and r.path in (DEFAULT, NAMED) and "POST" in r.methods}
        if len(self._routes) != 2:
            raise RuntimeError(f"the classify routes are not {DEFAULT} and {NAMED} any more: {sorted(self._routes)}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        params: dict[str, Any] = {}
        if path == DEFAULT:
            route = self._routes[DEFAULT]
        elif path.startswith(PREFIX) and path.endswith(SUFFIX) and "/" not in path[len(PREFIX) : -len(SUFFIX)] \
                and len(path) > len(PREFIX) + len(SUFFIX):
            route, params = self._routes[NAMED], {"model": path[len(PREFIX) : -len(SUFFIX)]}
        else:
            return await self.app(scope, receive, send)
        state = scope["app"].state.app_state
        headers = scope["headers"]
        if not is_json(media_type(_header(headers, b"content-type") or "")):
            return await self.app(scope, receive, send)
        try:
            check_key(state, _header(headers, b"authorization"))
        except APIError:
            return await self.app(scope, receive, send)  # the framework answers 401 as ever
        message = await receive()
        body = message.get("body", b"")
        again = given_first(message, receive)
        if message["type"] != "http.request" or message.get("more_body", False) or not body:
            return await self.app(scope, again, send)
        try:
            parsed = ClassifyRequest.model_validate(json.loads(body))
        except (ValueError, RecursionError, ValidationError):  # not JSON (or not UTF-8, or nested past Python's
            # recursion limit), or not a valid body: the framework says why
            return await self.app(scope, again, send)
        scope["route"], scope["endpoint"], scope["path_params"] = route, route.endpoint, params
        request = Request(scope, again)
        try:
            response = await route.endpoint(request=request, state=state, body=parsed, **params)
        except APIError as e:
            response = api_error(request, e)
        await response(scope, again, send)
