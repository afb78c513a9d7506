"""The admin page in headless Chromium: sign in, upload, chat, compare, pin, delete; a wrong token sees nothing."""

from __future__ import annotations

import re

import httpx
import pytest
from playwright.sync_api import Page, expect

from loraserve.resources import SAMPLE_ADAPTERS
from tests.server.conftest import ADMIN, ADMIN_TOKEN

pytestmark = pytest.mark.slow

SAMPLES = SAMPLE_ADAPTERS
PEFT_FILES = [SAMPLES / "robot" / "adapter_config.json", SAMPLES / "robot" / "adapter_model.safetensors"]
PIRATE_FILES = [SAMPLES / "pirate" / "adapter_config.json", SAMPLES / "pirate" / "adapter_model.safetensors"]


@pytest.fixture
def page(browser, ui_server) -> Page:
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    page = context.new_page()
    page.goto(f"{ui_server.url}/admin/ui/")
    yield page
    context.close()


def sign_in(page: Page, token: str = ADMIN_TOKEN) -> None:
    page.get_by_label("Admin token").fill(token)
    page.get_by_role("button", name="Sign in").click()


def ui_server_record(server, name: str) -> dict:
    return httpx.get(f"{server.url}/admin/adapters/{name}", headers=ADMIN).json()


def row(page: Page, name: str):
    return page.locator(f'#adapters-table tbody tr[data-name="{name}"]')


def test_wrong_token_shows_an_error_and_reveals_no_data(page):
    sign_in(page, "not-the-token")
    expect(page.get_by_role("alert").first).to_have_text("That admin token was refused.")
    expect(page.locator("#console")).to_be_hidden()
    assert page.locator("#adapters-table tbody tr").count() == 0
    assert "not-the-token" not in page.url
    assert page.evaluate("sessionStorage.length") == 0


def test_sign_in_upload_chat_compare_pin_delete(page, ui_server):
    sign_in(page)
    expect(row(page, "pirate")).to_be_visible()
    assert ADMIN_TOKEN not in page.url
    assert page.evaluate("Object.values(sessionStorage)") == [ADMIN_TOKEN]

    form = page.locator("#upload-form")
    form.get_by_label("Name").fill("ui-robot")
    form.get_by_label("PEFT files or one archive").set_input_files([str(p) for p in PEFT_FILES])
    form.get_by_label("Description").fill("uploaded from the page")
    form.get_by_role("button", name="Upload").click()
    expect(page.get_by_role("status")).to_contain_text("Uploaded ui-robot: rank 8")
    expect(row(page, "ui-robot")).to_contain_text("uploaded from the page")
    expect(row(page, "ui-robot").locator(".status")).to_have_text("ready")

    form.get_by_label("Name").fill("ui-robot")
    form.get_by_label("PEFT files or one archive").set_input_files([str(p) for p in PEFT_FILES])
    form.get_by_role("button", name="Upload").click()
    expect(page.get_by_role("status")).to_have_text(re.compile(r"Refused: adapter 'ui-robot' already exists"))

    first_sha = ui_server_record(ui_server, "ui-robot")["sha256"]
    form.get_by_label("Name").fill("ui-robot")
    form.get_by_label("PEFT files or one archive").set_input_files([str(p) for p in PIRATE_FILES])
    form.get_by_label(re.compile("Replace: new weights")).check()
    form.get_by_role("button", name="Upload").click()
    expect(page.get_by_role("status")).to_contain_text("Replaced ui-robot: rank 8")
    row(page, "ui-robot").get_by_role("button", name="Versions of ui-robot").click()
    versions = page.locator("#versions-list li")
    expect(versions).to_have_count(2)
    expect(versions.nth(1)).to_contain_text("(current)")
    versions.nth(0).get_by_role("button", name=f"Roll back ui-robot to {first_sha[:12]}").click()
    expect(versions.nth(0)).to_contain_text("(current)")
    assert ui_server_record(ui_server, "ui-robot")["sha256"] == first_sha
    page.locator("#versions-dialog").get_by_role("button", name="Close").click()
    form.get_by_label(re.compile("Replace: new weights")).uncheck()

    page.get_by_label("Filter").fill("ui-")
    expect(page.locator("#adapters-table tbody tr")).to_have_count(1)
    page.get_by_label("Filter").fill("")

    page.get_by_role("button", name="Chat").click()
    page.get_by_label("First model", exact=True).select_option("ui-robot")
    page.get_by_label("Message").fill("Hello, who are you?")
    page.keyboard.press("Enter")
    reply = page.locator('.pane[data-pane="0"] .assistant.done')
    expect(reply).to_have_count(1, timeout=60_000)
    assert reply.inner_text().strip(), "the streamed reply arrived"

    page.get_by_label("Compare two models side by side").check()
    page.get_by_role("button", name="Clear").click()
    page.get_by_label("First model", exact=True).select_option("ui-robot")
    page.get_by_label("Second model", exact=True).select_option("pirate")
    page.get_by_label("Message").fill("What is the best way to spend a Sunday?")
    page.get_by_role("button", name="Send").click()
    left, right = page.locator('.pane[data-pane="0"] .assistant'), page.locator('.pane[data-pane="1"] .assistant')
    expect(page.locator(".assistant.done")).to_have_count(2, timeout=60_000)
    assert left.get_attribute("data-model") == "ui-robot" and right.get_attribute("data-model") == "pirate"
    assert left.inner_text() != right.inner_text(), "two adapters, two answers"
    assert "Arr" in right.inner_text(), "the pirate speaks like one"

    page.get_by_role("button", name="Adapters").click()
    row(page, "ui-robot").get_by_role("button", name="Pin ui-robot").click()
    expect(row(page, "ui-robot").locator(".residency")).to_have_text("device (pinned)")
    row(page, "ui-robot").get_by_role("button", name="Unpin ui-robot").click()
    expect(row(page, "ui-robot").locator(".residency")).not_to_contain_text("pinned")

    row(page, "ui-robot").get_by_role("button", name="Edit ui-robot").click()
    dialog = page.locator("#edit-dialog")
    dialog.get_by_label("Persona system prompt").fill("You are a robot.")
    dialog.get_by_role("button", name="Save").click()
    expect(dialog).to_be_hidden()
    assert ui_server_record(ui_server, "ui-robot")["system_prompt"] == "You are a robot."

    row(page, "ui-robot").get_by_role("button", name="Delete ui-robot").click()
    expect(page.locator("#confirm-dialog")).to_contain_text("Delete ui-robot?")
    page.locator("#confirm-dialog").get_by_role("button", name="Delete").click()
    expect(row(page, "ui-robot")).to_have_count(0)

    page.get_by_role("button", name="Live").click()
    expect(page.locator("#kv-text")).to_contain_text("pages hold KV blocks")
    expect(page.locator("#prefix-text")).to_contain_text("prompt tokens found instead of computed")
    expect(page.locator("#speculation-text")).to_contain_text("Speculative decoding: no drafts verified")
    expect(page.locator("#slot-text")).to_contain_text("of 4 slots used")


def test_keys_created_shown_once_used_and_revoked_from_the_page(page, ui_server):
    sign_in(page)
    page.get_by_role("button", name="Keys").click()
    expect(page.locator("#auth-mode")).to_contain_text("Inference is open")
    form = page.locator("#key-form")
    form.get_by_label("Tenant").fill("ui-tenant")
    form.get_by_label("Weight").fill("2")
    form.get_by_label("Requests per minute").fill("100")
    form.get_by_label("Allowed models").fill("pirate, robot")
    form.get_by_role("button", name="Create key").click()
    shown = page.locator("#new-key code")
    expect(shown).to_have_text(re.compile(r"^lsk-"))
    key = shown.inner_text()
    tenant = page.locator('#keys-table tbody tr[data-tenant="ui-tenant"]')
    expect(tenant).to_contain_text("pirate, robot")
    assert key not in tenant.inner_text() and key[:10] in tenant.inner_text(), "the table shows a prefix only"

    chat = {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with_key = {"Authorization": f"Bearer {key}"}
    assert httpx.post(f"{ui_server.url}/v1/chat/completions", json=chat, headers=with_key).status_code == 200

    form.get_by_label("Tenant").fill("ui-tenant")
    form.get_by_label("Weight").fill("3")
    form.get_by_role("button", name="Create key").click()
    expect(page.locator("#new-key")).to_have_text(re.compile(r"Refused: .*tenant 'ui-tenant' has weight 2"))

    tenant.get_by_role("button", name=f"Revoke {key[:10]}…").click()
    expect(page.locator("#confirm-dialog")).to_contain_text(f"Revoke ui-tenant's key {key[:10]}…?")
    page.locator("#confirm-dialog").get_by_role("button", name="Revoke").click()
    expect(tenant).to_have_count(0)
    assert httpx.get(f"{ui_server.url}/admin/keys", headers=ADMIN).json()["data"] == []

    expect(page.locator("#auth-mode")).to_contain_text("needs an API key")  # no key left: still closed
    assert httpx.post(f"{ui_server.url}/v1/chat/completions", json=chat).status_code == 401
    page.get_by_role("button", name="Open to everyone").click()
    page.locator("#confirm-dialog").get_by_role("button", name="Open to everyone").click()
    expect(page.locator("#auth-mode")).to_contain_text("Inference is open")
    assert httpx.post(f"{ui_server.url}/v1/chat/completions", json=chat).status_code == 200
