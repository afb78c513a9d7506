// Tenants' API keys: the list (never the keys themselves), creating one (its key shown once), revoking; and the
// inference-auth mode (open, or keys), which only an admin's explicit choice opens again.
import { actThenRefresh, call } from "./api.js";
import { confirmThen } from "./confirm.js";
import { element } from "./format.js";

const $ = (id) => document.getElementById(id);

export async function refreshKeys() {
  try {
    const listed = await call("GET", "/admin/keys");
    const records = listed.data;
    showAuth(listed.auth);
    $("keys-table").tBodies[0].replaceChildren(...records.map(row));
    $("key-count").textContent = `${records.length} keys`;
    $("keys-error").textContent = "";
  } catch (error) {
    $("keys-error").textContent = error.message;
  }
}

const AUTH = {
  open: { text: "Inference is open: any client that reaches the server may use it.", next: "keys",
    button: "Require keys", confirm: "Require an API key (or the admin token) for inference on every server?" },
  keys: { text: "Inference needs an API key (or the admin token).", next: "open",
    button: "Open to everyone", confirm: "Open inference to any client, without a key, on every server?" },
};

function showAuth(mode) {
  const shown = AUTH[mode];
  $("auth-mode").dataset.mode = mode;
  $("auth-text").textContent = shown.text;
  const toggle = $("auth-toggle");
  toggle.textContent = shown.button;
  toggle.className = mode === "keys" ? "danger" : "";
  toggle.onclick = () => confirmThen(shown.confirm, shown.button,
    () => act(() => call("PUT", "/admin/auth", { mode: shown.next })));
}

export function clearKeys() {
  $("keys-table").tBodies[0].replaceChildren();
  $("new-key").replaceChildren();
}

function limit(value) {
  return value === null ? "no limit" : value.toLocaleString("en");
}

function row(record) {
  const key = `${record.key_prefix}…`;
  const revoke = element("button", { type: "button", className: "danger", ariaLabel: `Revoke ${key}`,
    onclick: () => confirmThen(`Revoke ${record.tenant}'s key ${key}? Its requests are refused from now on.`,
      "Revoke", () => act(() => call("DELETE", `/admin/keys/${record.id}`))) }, "Revoke");
  return element("tr", { dataset: { id: record.id, tenant: record.tenant } },
    element("td", {}, element("strong", {}, record.tenant)),
    element("td", {}, element("code", {}, key)),
    element("td", {}, String(record.weight)),
    element("td", {}, limit(record.requests_per_minute)),
    element("td", {}, limit(record.tokens_per_minute)),
    element("td", {}, record.allowed_models === null ? "all" : record.allowed_models.join(", ")),
    element("td", {}, new Date(record.created_at).toLocaleString()),
    element("td", { className: "actions" }, revoke));
}

function act(action) {
  return actThenRefresh(action, $("keys-error"), refreshKeys);
}

function optionalNumber(input) {
  return input.value.trim() === "" ? null : Number(input.value);
}

async function submitKey(event) {
  event.preventDefault();
  const form = event.target;
  const models = form.elements.allowed_models.value.split(",").map((m) => m.trim()).filter(Boolean);
  const body = {
    tenant: form.elements.tenant.value.trim(),
    weight: Number(form.elements.weight.value),
    requests_per_minute: optionalNumber(form.elements.requests_per_minute),
    tokens_per_minute: optionalNumber(form.elements.tokens_per_minute),
    allowed_models: models.length ? models : null,
  };
  const shown = $("new-key");
  shown.className = "";
  try {
    const created = await call("POST", "/admin/keys", body);
    shown.replaceChildren(`Key of ${created.tenant} (shown only now, copy it): `, element("code", {}, created.key));
    form.reset();
  } catch (error) {
    shown.className = "error";
    shown.textContent = `Refused: ${error.message}`;
  }
  await refreshKeys();
}

export function setUpKeys() {
  $("key-form").addEventListener("submit", submitKey);
}
