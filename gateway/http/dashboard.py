"""`GET /dashboard`: a live page of the gateway's state, served from the package (no CDN).

The page holds no data: its HTML, script and style are the same for everyone, so they are
served without a key. A browser cannot put a bearer header on a navigation, so the page asks
for the admin key, keeps it in the tab's `sessionStorage` (gone when the tab closes, never a
cookie: nothing is sent on its own, no cross-site request can carry it) and sends it as
`Authorization: Bearer <key>` on each poll of `/admin/status`, which passes the `AdminGate`
as any other admin call. The Content-Security-Policy lets the page load only its own script
and style and talk only to this origin.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

ASSETS = resources.files("gateway") / "assets" / "dashboard"

HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}

FILES = {
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/style.css": ("style.css", "text/css; charset=utf-8"),
}


def pages() -> list[tuple[str, Callable[[Request], Awaitable[Response]]]]:
    """The page's routes, each answering its file (read once, here)."""

    def serve(body: bytes, media_type: str) -> Callable[[Request], Awaitable[Response]]:
        async def page(request: Request) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        return page

    return [
        (path, serve((ASSETS / name).read_bytes(), media_type))
        for path, (name, media_type) in FILES.items()
    ]
