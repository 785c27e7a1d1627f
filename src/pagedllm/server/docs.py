"""/docs: Swagger UI from assets this server serves itself (the fastapi-offline package ships
them), so the page works on a machine without internet; FastAPI's default loads them from a
CDN and shows a blank page there."""
from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles

DOCS_PATH = "/docs"
ASSETS_PATH = "/docs-assets"
# Open without a key, like /health: the page and the schema say how to call the API, not
# what anyone asked it (vLLM serves them openly too).
OPEN_PATHS = (DOCS_PATH, "/openapi.json")
OPEN_PREFIXES = (ASSETS_PATH + "/",)


def install_docs(app: FastAPI) -> None:
    assets = files("fastapi_offline") / "static"
    app.mount(ASSETS_PATH, StaticFiles(directory=str(assets)), name="docs-assets")

    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger_ui():
        return get_swagger_ui_html(
            openapi_url=app.openapi_url, title=f"{app.title} API",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon.png")
