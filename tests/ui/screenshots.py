"""Screenshots of the admin page's main views for docs/ and the README.

.venv/bin/python -m tests.ui.screenshots        # writes docs/admin-*.png (~1 minute)
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from playwright.sync_api import expect, sync_playwright

from loraserve.config import ModelConfig
from loraserve.models import load_model
from tests.conftest import CHROMIUM, CHROMIUM_FLAGS
from tests.server.conftest import ADMIN_TOKEN, start_server

DOCS = Path(__file__).resolve().parents[2] / "docs"
PERSONAS = ("pirate", "robot", "shakespeare", "french-tutor")


def _chat(url: str, model: str, i: int) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me fact number {i}."}], "max_tokens": 48}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def main() -> None:
    loaded = load_model(ModelConfig(dtype="float32"))
    with tempfile.TemporaryDirectory() as data_dir, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        for server in start_server(loaded, Path(data_dir), max_loras=4, register_samples=True):
            page = browser.new_page(viewport={"width": 1366, "height": 860})
            page.goto(f"{server.url}/admin/ui/")
            page.get_by_label("Admin token").fill(ADMIN_TOKEN)
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("button", name="Chat").click()
            page.get_by_label("Compare two models side by side").check()
            page.get_by_label("First model", exact=True).select_option("pirate")
            page.get_by_label("Second model", exact=True).select_option("shakespeare")
            page.get_by_label("Message").fill("What is the best way to spend a Sunday?")
            page.get_by_role("button", name="Send").click()
            expect(page.locator(".assistant.done")).to_have_count(2, timeout=120_000)
            page.screenshot(path=DOCS / "admin-chat.png")
            page.get_by_role("button", name="Adapters").click()
            page.locator('#adapters-table tbody tr[data-name="pirate"]').get_by_role(
                "button", name="Pin pirate"
            ).click()
            expect(page.locator('#adapters-table tbody tr[data-name="pirate"] .residency')).to_contain_text("pinned")
            page.screenshot(path=DOCS / "admin-adapters.png", full_page=True)
            with ThreadPoolExecutor(8) as traffic:  # something for the live charts to show
                futures = [traffic.submit(_chat, server.url, PERSONAS[i % 4], i) for i in range(24)]
                page.get_by_role("button", name="Live").click()
                page.wait_for_timeout(15_000)
                page.screenshot(path=DOCS / "admin-live.png")
                for future in futures:
                    future.result()
            page.get_by_role("button", name="Keys").click()  # last: once a key exists, inference needs one
            for tenant, weight, rpm, models in (("acme", "2", "600", ""), ("pirate-fans", "1", "60", "pirate")):
                form = page.locator("#key-form")
                form.get_by_label("Tenant").fill(tenant)
                form.get_by_label("Weight").fill(weight)
                form.get_by_label("Requests per minute").fill(rpm)
                form.get_by_label("Allowed models").fill(models)
                form.get_by_role("button", name="Create key").click()
                expect(page.locator(f'#keys-table tbody tr[data-tenant="{tenant}"]')).to_have_count(1)
            page.screenshot(path=DOCS / "admin-keys.png")
        browser.close()
    print(f"wrote {', '.join(str(p) for p in sorted(DOCS.glob('admin-*.png')))}")


if __name__ == "__main__":
    main()
