"""The API's interactive docs, served entirely by the API itself: no CDN, so they work air-gapped.

FastAPI's default `/docs` and `/redoc` pages load Swagger UI, ReDoc and a favicon from public hosts
(and ReDoc its fonts from Google Fonts). `mount_docs` serves the same pages with every asset taken
from the pinned `fastapi-offline` package (Swagger UI's and ReDoc's dist files, FastAPI's favicon):

- `/docs`: Swagger UI over the app's own OpenAPI document,
- `/docs/oauth2-redirect`: Swagger UI's OAuth2 redirect page (inline, no assets),
- `/redoc`: ReDoc over the same document (system fonts),
- `/docs/static/...`: the JS, CSS and favicon.

The pages carry a Content-Security-Policy that lets the browser load nothing from another origin.

Create the app with `FastAPI(..., docs_url=None, redoc_url=None)`, then call `mount_docs(app)`.
Every URL is prefixed with the request's `root_path`, so the pages also work behind a path-prefix proxy.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
STATIC_URL = "/docs/static"

SWAGGER_JS = "swagger-ui-bundle.js"
SWAGGER_CSS = "swagger-ui.css"
REDOC_JS = "redoc.standalone.js"
FAVICON = "favicon.png"
ASSETS = (SWAGGER_JS, SWAGGER_CSS, REDOC_JS, FAVICON)

# Swagger UI shows a badge loaded from validator.swagger.io for specs not on localhost: never ask a public host.
SWAGGER_UI_PARAMETERS = {"validatorUrl": None}
# The docs pages may load nothing from another origin, whatever a future Swagger UI or ReDoc build references
# (ReDoc 2 shows a logo from cdn.redoc.ly, hidden when it cannot load): the browser refuses before any request.
# Inline scripts and styles: FastAPI's page starts Swagger UI inline, both UIs style inline; ReDoc searches in a
# blob: worker.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data: blob:; font-src 'self' data:; worker-src 'self' blob:; "
                           "connect-src 'self'")


def assets_dir() -> Path:
    """The folder of the docs' JS, CSS and favicon (the `fastapi-offline` package's static files)."""
    try:
        root = Path(str(files("fastapi_offline").joinpath("static")))
    except ModuleNotFoundError:
        raise RuntimeError("the API docs need the 'fastapi-offline' package: pip install -e . "
                           "(it is one of the project's dependencies)") from None
    missing = [name for name in ASSETS if not (root / name).is_file()]
    if missing:
        raise RuntimeError(f"the API docs' assets are missing from {root}: {', '.join(missing)} "
                           "(is the pinned fastapi-offline version installed?)")
    return root


def mount_docs(app: FastAPI) -> None:
    """Serve Swagger UI at /docs and ReDoc at /redoc with assets from the package (none from a CDN).

    The app must have been created with `docs_url=None, redoc_url=None` (FastAPI's own pages load
    their assets from public hosts) and must serve its OpenAPI document (`openapi_url` not None)."""
    if app.docs_url is not None or app.redoc_url is not None:
        raise ValueError("create the app with FastAPI(..., docs_url=None, redoc_url=None) before mount_docs: "
                         "FastAPI's own docs pages load their assets from a CDN")
    openapi_url = app.openapi_url
    if openapi_url is None:
        raise ValueError("mount_docs needs the app's OpenAPI document (openapi_url is None)")
    app.mount(STATIC_URL, StaticFiles(directory=assets_dir()), name="docs-static")

    def static(request: Request, name: str) -> str:
        return f"{_root(request)}{STATIC_URL}/{name}"

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        return _same_origin_only(get_swagger_ui_html(
            openapi_url=f"{_root(request)}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=static(request, SWAGGER_JS),
            swagger_css_url=static(request, SWAGGER_CSS),
            swagger_favicon_url=static(request, FAVICON),
            oauth2_redirect_url=f"{_root(request)}{OAUTH2_REDIRECT_URL}",
            init_oauth=app.swagger_ui_init_oauth,
            swagger_ui_parameters={**SWAGGER_UI_PARAMETERS, **(app.swagger_ui_parameters or {})},
        ))

    @app.get(OAUTH2_REDIRECT_URL, include_in_schema=False)
    async def swagger_ui_oauth2_redirect() -> HTMLResponse:
        return _same_origin_only(get_swagger_ui_oauth2_redirect_html())

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return _same_origin_only(get_redoc_html(
            openapi_url=f"{_root(request)}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=static(request, REDOC_JS),
            redoc_favicon_url=static(request, FAVICON),
            with_google_fonts=False,
        ))


def _same_origin_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    return page


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")
