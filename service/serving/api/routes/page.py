"""The credit page: ``GET /`` and its static files (self-contained, works offline)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[1] / "static"

router = APIRouter(include_in_schema=False)
static = StaticFiles(directory=STATIC)


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")
