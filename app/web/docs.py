"""The OpenAPI docs page (``/api/docs``) with Swagger UI served by the studio itself.

FastAPI's default docs page loads Swagger UI from a CDN, so it is blank on a machine without
internet. Swagger UI comes from npm at build time instead (``swagger-ui-dist``, copied into
``static/vendor/`` by ``static/copy-vendor.mjs``) and the page names only local URLs.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from starlette.responses import HTMLResponse

DOCS_URL = "/api/docs"
OAUTH2_REDIRECT_URL = "/api/docs/oauth2-redirect"
VENDOR = "/static/vendor"


def install(app: FastAPI) -> None:
    """Serve the docs page and Swagger UI's OAuth2 redirect page on ``app`` (create the app with
    ``docs_url=None`` so FastAPI does not add its CDN-based page)."""

    async def docs(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/api/openapi.json",
            title=f"{app.title} API",
            swagger_js_url=f"{VENDOR}/swagger-ui-bundle.js",
            swagger_css_url=f"{VENDOR}/swagger-ui.css",
            swagger_favicon_url=f"{VENDOR}/swagger-ui-favicon.png",
            oauth2_redirect_url=OAUTH2_REDIRECT_URL,
            # no call to swagger.io's online validator either
            swagger_ui_parameters={"validatorUrl": None})

    async def oauth2_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    app.add_route(DOCS_URL, docs, include_in_schema=False)
    app.add_route(OAUTH2_REDIRECT_URL, oauth2_redirect, include_in_schema=False)
