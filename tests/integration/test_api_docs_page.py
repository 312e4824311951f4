"""The ingest API's interactive docs work air-gapped: /docs (Swagger UI) and /redoc (ReDoc) take every
script, stylesheet and icon from the API itself, and render in a real browser that can reach no other host."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest

from tests.harness import free_port, start_api

PAGES = ("/docs", "/redoc")
# What each page must have rendered from the API's own OpenAPI document: proof that its scripts ran.
RENDERED = {"/docs": ('data-path="/v1/sends"', 'class="opblock opblock-post"'),
            "/redoc": (">/v1/sends<", "operation-type post")}
# The requests each page must make (to the API): also proof that the request log below was read right.
EXPECTED_REQUESTS = {"/docs": ("/docs/static/swagger-ui-bundle.js", "/docs/static/swagger-ui.css", "/openapi.json"),
                     "/redoc": ("/docs/static/redoc.standalone.js", "/openapi.json")}
CSP_VIOLATION = re.compile(r'"([^"]*) violates the following Content Security Policy directive')
# ReDoc 2 shows its vendor's logo from a CDN in its menu and hides it when it cannot load: the policy refuses it.
REDOC_LOGO = "Loading the image 'https://cdn.redoc.ly/"


@pytest.fixture
def api(processes, redis_client, namespace):
    return start_api(processes, free_port(), {"a": "tenant-a"}, redis_client, namespace)


class _References(HTMLParser):
    """The URLs a page makes the browser load: src/href attributes, ReDoc's spec-url, and the URL
    Swagger UI is started with in the page's inline script."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self._in_script = tag == "script"
        for name, value in attrs:
            if name in ("src", "href", "spec-url") and value:
                self.urls.append(value)

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.urls += re.findall(r"""\burl:\s*['"]([^'"]+)['"]""", data)


def test_docs_pages_load_every_asset_from_the_api_itself(api):
    """Given the ingest API,
    When /docs and /redoc are fetched,
    Then each is an HTML page under a Content-Security-Policy that allows only the API's own origin, names no
    http(s) URL of any other origin, and every script, stylesheet, icon and OpenAPI document it references is
    served by the API itself (200, not empty)."""
    origin = str(api.base_url).rstrip("/")
    for page in PAGES:
        r = api.get(page)
        assert r.status_code == 200, f"{page}: {r.status_code} {r.text[:200]}"
        assert r.headers["content-type"].startswith("text/html")
        html = r.text
        foreign = [u for u in re.findall(r"""https?://[^\s'"<>)]+""", html) if not u.startswith(origin + "/")]
        assert not foreign, f"{page} names URLs of other hosts: {foreign}"
        assert "default-src 'self'" in r.headers.get("content-security-policy", ""), r.headers

        parser = _References()
        parser.feed(html)
        assert parser.urls, f"{page} references no asset at all:\n{html}"
        for ref in parser.urls:
            url = urljoin(f"{origin}{page}", ref)
            assert urlsplit(url).netloc == urlsplit(origin).netloc, f"{page} references {ref!r} on another host"
            asset = api.get(url)
            assert asset.status_code == 200 and asset.content, f"{page} references {ref}: {asset.status_code}"
        assert any(u.endswith(".js") for u in parser.urls), f"{page} loads no script: {parser.urls}"


def _browse(chromium: str, url: str, workdir: Path, *action: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Open `url` in headless Chromium that resolves no host but 127.0.0.1 (an air gap); returns the run
    (stdout, and the console on stderr) and the URLs the page itself requested (from Chromium's net log)."""
    workdir.mkdir(parents=True)
    net_log = workdir / "net-log.json"
    run = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
         f"--user-data-dir={workdir / 'profile'}",
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
         "--disable-features=AutofillServerCommunication",  # the browser's own calls, not the page's
         "--enable-logging=stderr", f"--log-net-log={net_log}",
         "--virtual-time-budget=10000", *action, url],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"chromium exited {run.returncode}:\n{run.stderr[-3000:]}"
    log = json.loads(net_log.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    site = f"{urlsplit(url).scheme}://{urlsplit(url).hostname}"
    # The page's requests are keyed by its site; Chromium's own (updates, time) are not.
    requested = [e["params"]["url"] for e in log["events"]
                 if e["type"] == start_job and "url" in e.get("params", {})
                 and str(e["params"].get("network_isolation_key", "")).startswith(site)]
    return run, requested


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (Debian: apt-get install -y chromium); .ci/run installs it")
def test_docs_render_in_a_browser_that_reaches_no_other_host(api, tmp_path):
    """Given the ingest API and headless Chromium that can resolve no host but 127.0.0.1,
    When it loads /docs and /redoc and runs their scripts,
    Then Swagger UI and ReDoc have rendered the API's operations (POST /v1/sends among them), every request the
    pages made went to the API (its scripts, stylesheet and /openapi.json among them), Swagger UI tried nothing
    that the pages' Content-Security-Policy refused (ReDoc only its vendor logo from cdn.redoc.ly, which it
    hides), and a screenshot of each page is left in the test's tmp_path."""
    chromium = shutil.which("chromium")
    assert chromium is not None
    origin = str(api.base_url).rstrip("/")
    for page in PAGES:
        name = page.strip("/")
        run, requested = _browse(chromium, f"{origin}{page}", tmp_path / f"{name}-dom", "--dump-dom")
        dom = run.stdout
        for marker in RENDERED[page]:
            assert marker in dom, f"{page} did not render {marker!r} (its scripts did not run?):\n{dom[:3000]}"

        foreign = [u for u in requested if not u.startswith(origin + "/")]
        assert not foreign, f"{page} requested other hosts: {foreign}"
        missing = [p for p in EXPECTED_REQUESTS[page] if f"{origin}{p}" not in requested]
        assert not missing, f"{page} never requested {missing} (requests seen: {requested})"

        refused = [v for v in CSP_VIOLATION.findall(run.stderr) if not (page == "/redoc" and v.startswith(REDOC_LOGO))]
        assert not refused, f"{page}: the Content-Security-Policy refused: {refused}"

        screenshot = tmp_path / f"{name}.png"
        _browse(chromium, f"{origin}{page}", tmp_path / f"{name}-screenshot",
                f"--screenshot={screenshot}", "--window-size=1280,2000")
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"no screenshot of {page} at {screenshot}"
        print(f"screenshot of {page}: {screenshot}")
