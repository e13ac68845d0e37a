"""/api/docs works offline: Swagger UI comes from static/vendor (npm at build time), not a CDN."""
from __future__ import annotations

import re

import pytest

from tests.web.test_web_browser import ARGS, CHROMIUM


def test_docs_page_names_only_local_assets_and_they_are_served(client):
    bearer = client.headers.pop("Authorization")
    anonymous = client  # the docs are public
    r = anonymous.get("/api/docs")
    assert r.status_code == 200 and "SwaggerUIBundle" in r.text
    urls = re.findall(r'(?:src|href)="([^"]+)"', r.text) + re.findall(r"url: '([^']+)'", r.text)
    assert sorted(urls) == ["/api/openapi.json", "/static/vendor/swagger-ui-bundle.js",
                            "/static/vendor/swagger-ui-favicon.png", "/static/vendor/swagger-ui.css"]
    assert not re.search(r"https?://", r.text)
    types = {}
    for url in urls:
        got = anonymous.get(url)
        assert got.status_code == 200, url
        types[url.rsplit("/", 1)[-1]] = got.headers["content-type"].split(";")[0]
    assert types == {"openapi.json": "application/json", "swagger-ui-bundle.js": "text/javascript",
                     "swagger-ui.css": "text/css", "swagger-ui-favicon.png": "image/png"}
    redirect = client.get("/api/docs/oauth2-redirect", headers={"Authorization": bearer})
    assert redirect.status_code == 200 and "oauth2" in redirect.text.lower()


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_docs_render_with_every_other_host_unreachable(server):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        outside: list[str] = []

        def only_local(route):
            if route.request.url.startswith(server):
                return route.continue_()
            outside.append(route.request.url)
            return route.abort()

        page.route("**/*", only_local)
        page.goto(f"{server}/api/docs")
        sync_api.expect(page.locator(".swagger-ui .info .title")).to_contain_text("Whetstone",
                                                                                  timeout=20_000)
        sync_api.expect(page.locator(".opblock-summary-path").first).to_be_visible()
        browser.close()
    assert outside == []
