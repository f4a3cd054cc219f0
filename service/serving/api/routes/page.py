"""The credit page: ``GET /`` and its static files (self-contained, works offline)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from service.serving.api.errors import not_allowed
from service.serving.core.errors import APIError

STATIC = Path(__file__).resolve().parents[1] / "static"

router = APIRouter(tags=["page"])
static = StaticFiles(directory=STATIC)


@router.get("/", response_class=HTMLResponse, summary="The credit page",
            responses={200: {"content": {"text/html": {}}, "description": "The page (HTML)"}})
async def page() -> FileResponse:
    """The credit page in a browser (`POST /` is Hugging Face's text classification, documented apart)."""
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.api_route("/", methods=["PUT", "PATCH", "DELETE", "OPTIONS"], include_in_schema=False)
async def other_method(request: Request) -> None:
    """405 naming both methods of ``/``: the page's GET and Hugging Face's POST (two routes, of which the framework
    would name one)."""
    raise APIError(405, not_allowed(request, "GET, POST"), headers={"Allow": "GET, POST"})
