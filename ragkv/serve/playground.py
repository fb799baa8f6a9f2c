"""The playground page at `/`: static files shipped inside the package (no build step, nothing from a CDN). The
page itself needs no key; the API calls it makes send the key the user types."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PATHS = ("/",)            # open without a key
STATIC_PREFIX = "/static/"     # every file under it is open without a key


def mount_playground(app: FastAPI) -> None:
    app.mount(STATIC_PREFIX.rstrip("/"), StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})
