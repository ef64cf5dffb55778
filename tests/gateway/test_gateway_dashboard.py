"""The dashboard page (`GET /dashboard`) in a real headless Chromium driven by Playwright,
against a real `infire gateway` fed by the scripted fault upstream: the totals agree with
the gateway's own analytics, every chart draws, the log table pages and filters, a row opens
its detail with the request body, and the page asks for the admin token the gateway
needs for its data. Screenshots go to tests/gateway/artifacts/. Skipped where
/usr/bin/chromium or the playwright package is missing, unless INFIRE_REQUIRE_BROWSER=1 (CI)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from fault_upstream import FaultUpstream
from gateway_harness import Gateway

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update",
               "--disable-sync"]  # fmt: skip
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHARTS = ["chart-requests", "chart-tokens", "chart-cost", "chart-errors", "chart-cache",
          "chart-latency"]  # fmt: skip
NEEDLE = "needle-7f3a2c <b>not bold</b>"  # markup in a body must show as text
METADATA = {"user": "ada", "team": "dashboards"}
TIMEOUT_MS = 20_000
ADMIN = "dashboard-admin-token"
AUTH = {"authorization": f"Bearer {ADMIN}"}
TOKEN_KEY = "infire-gateway-admin-token"  # where the page keeps the token (sessionStorage)


@dataclass(slots=True)
class Traffic:
    """What the test sent through the gateway, by the log ids the gateway answered with."""

    ids: list[str] = field(default_factory=list)
    error_ids: list[str] = field(default_factory=list)
    needle_id: str = ""


@dataclass(slots=True)
class Dashboard:
    """An open dashboard page, and the JavaScript errors it raised."""

    page: Page
    errors: list[str]


def _require_browser() -> None:
    problem = None
    if not CHROMIUM.exists():
        problem = "/usr/bin/chromium is not installed (apt-get install chromium)"
    elif importlib.util.find_spec("playwright") is None:
        problem = "the playwright package is not installed (pip install playwright)"
    if problem is not None:
        if os.environ.get("INFIRE_REQUIRE_BROWSER") == "1":
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    _require_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=LAUNCH_ARGS, headless=True
        )
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[FaultUpstream]:
    with FaultUpstream(models=("fault-model", "fault-model-mini")) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(upstream: FaultUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = f"""
[gateways.main]
[gateways.staging]

[providers.openai]
kind = "openai"
base_url = "{upstream.base_url}"

[prices."openai/fault-model"]
input = 3.0
output = 5.0

[prices."openai/fault-model-mini"]
input = 1.0
output = 2.0

[server]
admin_sha256 = "{hashlib.sha256(ADMIN.encode()).hexdigest()}"
"""
    gw = Gateway(config, tmp_path_factory.mktemp("gateway-dashboard"))
    yield gw
    gw.stop()


def _chat(content: str, model: str = "fault-model", **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def _send(gw: Gateway, path: str, body: dict, **headers: str) -> str:
    """POSTs (reading a stream to its end) and returns the request's log id."""
    with httpx.stream("POST", f"{gw.url}{path}", json=body, headers=headers, timeout=30) as r:
        r.read()
        return r.headers["cf-aig-log-id"]


@pytest.fixture(scope="module")
def traffic(gateway: Gateway, upstream: FaultUpstream) -> Traffic:
    """32 requests: 18 plain, 4 scripted 500s, 1 cache MISS + 4 HITs, 4 streamed, then the
    needle (with metadata), which is the newest row."""
    sent = Traffic()
    chat, compat = "/main/openai/chat/completions", "/main/compat/chat/completions"
    for i in range(18):
        if i % 3:
            sent.ids.append(_send(gateway, chat, _chat(f"question number {i}")))
        else:
            body = _chat(f"short question {i}", model="openai/fault-model-mini")
            sent.ids.append(_send(gateway, compat, body))
    upstream.script(["status:500"] * 4, key="boom")
    for i in range(4):
        log_id = _send(gateway, chat, _chat(f"doomed {i}"), **{"x-fault-key": "boom"})
        sent.error_ids.append(log_id)
    sent.ids += sent.error_ids
    for _ in range(5):
        cached = _chat("the same question every time")
        sent.ids.append(_send(gateway, chat, cached, **{"cf-aig-cache-ttl": "60"}))
    for i in range(4):
        sent.ids.append(_send(gateway, chat, _chat(f"stream number {i}", stream=True)))
    sent.needle_id = _send(gateway, chat, _chat(NEEDLE),
                           **{"cf-aig-metadata": json.dumps(METADATA)})  # fmt: skip
    sent.ids.append(sent.needle_id)
    # the log is written after the answer: wait until every row is there
    deadline = time.monotonic() + 10
    while _logs(gateway)["total"] < len(sent.ids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _logs(gateway)["total"] == len(sent.ids) == 32
    return sent


def _logs(gw: Gateway, **params: object) -> dict:
    r = httpx.get(f"{gw.url}/main/logs", params=params, headers=AUTH, timeout=10)
    r.raise_for_status()
    return r.json()


@pytest.fixture
def dashboard(browser: Browser, gateway: Gateway, traffic: Traffic) -> Iterator[Dashboard]:
    """The dashboard, signed in, opened on gateway main over the last hour, with its first
    load done."""
    r = httpx.get(f"{gateway.url}/dashboard", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_init_script(f"sessionStorage.setItem({TOKEN_KEY!r}, {ADMIN!r})")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(f"{gateway.url}/dashboard")
    page.wait_for_selector("#gateway option[value=staging]", state="attached")
    page.select_option("#gateway", "main")
    page.select_option("#range", "3600")
    _settle(page)
    yield Dashboard(page, errors)
    context.close()


def _settle(page: Page) -> None:
    """Waits until the page's loads are done (it marks body[data-loading] meanwhile)."""
    page.wait_for_function("!document.body.dataset.loading && !!document.querySelector("
                           "'#logs tr')", timeout=TIMEOUT_MS)  # fmt: skip


def _row_ids(page: Page) -> list[str]:
    return page.eval_on_selector_all("#logs tr[data-id]", "rows => rows.map(r => r.dataset.id)")


def _drawn(page: Page, chart_id: str) -> int:
    """How many visible data marks (bars, line paths, dots) the chart's SVG holds."""
    return page.evaluate(
        """id => [...document.getElementById(id).querySelectorAll('.series')].filter(e =>
            e.tagName === 'rect' ? +e.getAttribute('height') > 0 && +e.getAttribute('width') > 0
            : e.tagName === 'path' ? (e.getAttribute('d') || '').length > 1
            : +e.getAttribute('r') > 0).length""",
        chart_id,
    )


def test_totals_and_charts(dashboard: Dashboard, gateway: Gateway, traffic: Traffic):
    from playwright.sync_api import expect

    page = dashboard.page
    now = int(time.time())
    analytics = httpx.get(f"{gateway.url}/main/analytics",
                          params={"start": now - 3600, "end": now + 1}, headers=AUTH,
                          timeout=10).json()  # fmt: skip
    total = analytics["total"]
    assert total["requests"] == len(traffic.ids) and total["errors"] == len(traffic.error_ids)
    requests = page.locator('#totals [data-metric="requests"]')
    expect(requests.locator(".value")).to_have_text(str(total["requests"]))
    expect(requests.locator(".sub")).to_have_text(f"{total['errors']} errors")
    error_rate = page.locator('#totals [data-metric="error_rate"] .value')
    expect(error_rate).to_have_text(f"{total['error_rate'] * 100:.1f}%")
    for metric in ("tokens_in", "tokens_out", "latency_ms_p50", "latency_ms_p95"):
        card = page.locator(f'#totals [data-metric="{metric}"]')
        assert float(card.get_attribute("data-value")) == total[metric], metric
    hit_rate = page.locator('#totals [data-metric="cache_hit_rate"]').get_attribute("data-value")
    assert float(hit_rate) == pytest.approx(total["cache_hit_rate"]) and total["cache_hits"] == 4
    assert float(page.locator('#totals [data-metric="cost"]').get_attribute("data-value")) > 0
    for chart_id in CHARTS:
        assert page.locator(f"#{chart_id}").count() == 1
        assert _drawn(page, chart_id) > 0, f"{chart_id} drew nothing"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert dashboard.errors == []


def test_log_table_pages_and_filters(dashboard: Dashboard, traffic: Traffic):
    from playwright.sync_api import expect

    page = dashboard.page
    rows = page.locator("#logs tr[data-id]")
    expect(rows).to_have_count(20)
    total = len(traffic.ids)
    expect(page.locator("#page-info")).to_have_text(f"1–20 of {total}")
    first_page = _row_ids(page)
    assert first_page[0] == traffic.needle_id  # newest first
    expect(page.locator("#prev")).to_be_disabled()
    page.click("#next")
    expect(rows).to_have_count(total - 20)
    expect(page.locator("#page-info")).to_have_text(f"21–{total} of {total}")
    expect(page.locator("#next")).to_be_disabled()
    assert sorted(first_page + _row_ids(page)) == sorted(traffic.ids)
    page.click("#prev")
    expect(rows).to_have_count(20)

    page.select_option("#filter-status", "5xx")
    expect(rows).to_have_count(len(traffic.error_ids))
    expect(page.locator("#page-info")).to_have_text("1–4 of 4")
    assert sorted(_row_ids(page)) == sorted(traffic.error_ids)
    assert set(rows.locator(".badge").all_text_contents()) == {"500"}

    page.select_option("#filter-status", "")
    page.select_option("#filter-cache", "HIT")
    expect(rows).to_have_count(4)
    page.select_option("#filter-cache", "")
    page.select_option("#filter-model", "fault-model-mini")
    expect(rows).to_have_count(6)
    assert set(rows.locator("td.model").all_text_contents()) == {"fault-model-mini"}
    assert dashboard.errors == []


def test_a_row_opens_its_detail(dashboard: Dashboard, traffic: Traffic):
    from playwright.sync_api import expect

    page = dashboard.page
    detail = page.locator("#detail")
    expect(detail).to_be_hidden()
    page.click(f'#logs tr[data-id="{traffic.needle_id}"]')
    expect(detail).to_be_visible()
    expect(page.locator("#detail-id")).to_have_text(traffic.needle_id)
    request_body = detail.locator("pre.body").nth(1)
    expect(request_body).to_contain_text(NEEDLE)  # the markup as text, not as elements
    expect(request_body).to_contain_text('"role": "user"')  # pretty-printed JSON
    expect(detail.locator("pre.body").first).to_contain_text('"team": "dashboards"')
    expect(detail.locator("pre.body").nth(2)).to_contain_text("echo: needle-7f3a2c")
    assert detail.locator("b").count() == 0
    expect(detail.locator("dl.fields")).to_contain_text("fault-model")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-detail.png"))
    page.click("#detail-close")
    expect(detail).to_be_hidden()
    assert dashboard.errors == []


def test_the_page_asks_for_the_admin_token(browser: Browser, gateway: Gateway, traffic: Traffic):
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{gateway.url}/dashboard")
    expect(page.locator("#signin")).to_be_visible()
    expect(page.locator("#error")).to_contain_text("admin token")
    expect(page.locator("#signout")).to_be_hidden()
    page.fill("#token", "not-the-token")
    page.click("#signin-submit")
    expect(page.locator("#error")).to_contain_text("admin token")
    expect(page.locator("#signin")).to_be_visible()
    assert page.evaluate(f"sessionStorage.getItem({TOKEN_KEY!r})") is None  # a wrong one is dropped
    page.fill("#token", ADMIN)
    page.click("#signin-submit")
    expect(page.locator("#signin")).to_be_hidden()
    expect(page.locator("#signout")).to_be_visible()
    expect(page.locator("#error")).to_be_hidden()
    _settle(page)
    expect(page.locator('#totals [data-metric="requests"] .value')).to_have_text(
        str(len(traffic.ids))
    )
    page.reload()  # kept for the tab
    _settle(page)
    expect(page.locator("#signin")).to_be_hidden()
    page.click("#signout")
    expect(page.locator("#signin")).to_be_visible()
    assert errors == []
    context.close()
