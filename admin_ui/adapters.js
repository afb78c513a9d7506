// The adapters table (sort, filter, pin, edit, versions and rollback, delete) and the upload form.
import { actThenRefresh, call, upload } from "./api.js";
import { confirmThen } from "./confirm.js";
import { bytes, element } from "./format.js";

const state = { records: [], sortKey: "name", ascending: true, filter: "" };
const $ = (id) => document.getElementById(id);

const sortValue = {
  tokens: (r) => r.prompt_token_count + r.completion_token_count,
  residency: (r) => `${r.residency}${r.pinned ? " pinned" : ""}`,
};

export async function refreshAdapters() {
  try {
    state.records = (await call("GET", "/admin/adapters")).data;
    $("adapters-error").textContent = "";
  } catch (error) {
    $("adapters-error").textContent = error.message;
  }
  render();
}

function visibleRecords() {
  const needle = state.filter.toLowerCase();
  const matches = state.records.filter((r) =>
    [r.name, r.status, r.description ?? "", r.residency].some((text) => text.toLowerCase().includes(needle)));
  const key = (r) => (sortValue[state.sortKey] ?? ((x) => x[state.sortKey]))(r);
  return matches.sort((a, b) => {
    const order = key(a) < key(b) ? -1 : key(a) > key(b) ? 1 : 0;
    return state.ascending ? order : -order;
  });
}

function render() {
  const rows = visibleRecords().map(row);
  $("adapters-table").tBodies[0].replaceChildren(...rows);
  $("adapter-count").textContent = `${rows.length} of ${state.records.length} adapters`;
  for (const button of document.querySelectorAll("#adapters-table th button")) {
    const sorted = button.dataset.sort === state.sortKey;
    button.closest("th").setAttribute("aria-sort", sorted ? (state.ascending ? "ascending" : "descending") : "none");
  }
}

function row(record) {
  const status = record.status === "failed"
    ? element("span", { className: "failed", title: record.status_reason ?? "" }, `failed: ${record.status_reason}`)
    : record.status;
  const residency = `${record.residency}${record.pinned ? " (pinned)" : ""}`;
  const actions = element("td", { className: "actions" },
    button(record.pinned ? "Unpin" : "Pin", `${record.pinned ? "Unpin" : "Pin"} ${record.name}`,
      () => act(() => call("POST", `/admin/adapters/${record.name}/${record.pinned ? "unpin" : "pin"}`))),
    button("Edit", `Edit ${record.name}`, () => edit(record)),
    button("Versions", `Versions of ${record.name}`, () => showVersions(record.name)),
    button("Delete", `Delete ${record.name}`, () => remove(record), "danger"));
  if (record.status !== "ready") actions.firstChild.disabled = true;
  return element("tr", { dataset: { name: record.name } },
    element("td", {}, element("strong", {}, record.name), element("div", { className: "muted" }, record.description ?? "")),
    element("td", {}, String(record.rank)),
    element("td", {}, record.target_modules.join(", ")),
    element("td", {}, bytes(record.size_bytes)),
    element("td", { className: "status" }, status),
    element("td", { className: "residency" }, residency),
    element("td", {}, String(record.request_count)),
    element("td", {}, String(record.prompt_token_count + record.completion_token_count)),
    actions);
}

function button(text, label, onClick, className = "") {
  return element("button", { type: "button", className, onclick: onClick, ariaLabel: label }, text);
}

function act(action) {
  return actThenRefresh(action, $("adapters-error"), refreshAdapters);
}

function edit(record) {
  const dialog = $("edit-dialog");
  $("edit-title").textContent = `Edit ${record.name}`;
  $("edit-description").value = record.description ?? "";
  $("edit-system-prompt").value = record.system_prompt ?? "";
  dialog.onclose = () => {
    if (dialog.returnValue !== "save") return;
    const changes = { description: $("edit-description").value || null, system_prompt: $("edit-system-prompt").value || null };
    act(() => call("PATCH", `/admin/adapters/${record.name}`, changes));
  };
  dialog.showModal();
}

async function showVersions(name) {
  const dialog = $("versions-dialog");
  $("versions-title").textContent = `Versions of ${name}`;
  $("versions-error").textContent = "";
  try {
    const { versions } = await call("GET", `/admin/adapters/${name}`);
    $("versions-list").replaceChildren(...versions.map((version) => versionItem(name, version)));
  } catch (error) {
    $("versions-error").textContent = error.message;
  }
  if (!dialog.open) dialog.showModal();
}

function versionItem(name, version) {
  const short = version.sha256.slice(0, 12);
  const when = new Date(version.created_at).toLocaleString();
  const text = `${short}: rank ${version.rank}, ${when}, by ${version.uploaded_by ?? "unknown"}`;
  const item = element("li", { dataset: { sha256: version.sha256 } }, text);
  if (version.current) item.append(" ", element("strong", {}, "(current)"));
  else {
    item.append(" ", button("Roll back", `Roll back ${name} to ${short}`, async () => {
      await act(() => call("POST", `/admin/adapters/${name}/rollback`, { sha256: version.sha256 }));
      await showVersions(name);
    }));
  }
  return item;
}

function remove(record) {
  confirmThen(`Delete ${record.name}? Running requests finish; new ones are refused.`, "Delete",
    () => act(() => call("DELETE", `/admin/adapters/${record.name}`)));
}

async function submitUpload(event) {
  event.preventDefault();
  const form = event.target;
  const data = new FormData();
  for (const field of ["name", "description", "system_prompt"]) {
    const value = form.elements[field].value.trim();
    if (value) data.append(field, value);
  }
  for (const file of form.elements.files.files) data.append("files", file, file.name);
  const progress = $("upload-progress");
  const status = $("upload-status");
  progress.hidden = false;
  progress.value = 0;
  status.className = "";
  status.textContent = "Uploading…";
  const replace = form.elements.replace.checked ? form.elements.name.value.trim() : null;
  try {
    const record = await upload(data, (fraction) => { progress.value = fraction; }, replace);
    const verb = replace ? "Replaced" : "Uploaded";
    status.textContent = `${verb} ${record.name}: rank ${record.rank}, ${record.target_modules.join(", ")}.`;
    form.reset();
  } catch (error) {
    status.className = "error";
    status.textContent = `Refused: ${error.message}`;
  } finally {
    progress.hidden = true;
  }
  await refreshAdapters();
}

export function setUpAdapters() {
  $("upload-form").addEventListener("submit", submitUpload);
  $("adapter-filter").addEventListener("input", (event) => { state.filter = event.target.value; render(); });
  for (const header of document.querySelectorAll("#adapters-table th button")) {
    header.addEventListener("click", () => {
      state.ascending = header.dataset.sort === state.sortKey ? !state.ascending : true;
      state.sortKey = header.dataset.sort;
      render();
    });
  }
}
