// Sign-in, view switching and periodic refresh; each view lives in its own module.
import { ApiError, call, token } from "./api.js";
import { refreshAdapters, setUpAdapters } from "./adapters.js";
import { refreshModels, setUpChat } from "./chat.js";
import { clearKeys, refreshKeys, setUpKeys } from "./keys.js";
import { refreshLive } from "./live.js";

const $ = (id) => document.getElementById(id);
const REFRESH_SECONDS = 3;
let timer = null;

function show(signedIn) {
  $("sign-in").hidden = signedIn;
  $("console").hidden = !signedIn;
  $("sign-out").hidden = !signedIn;
}

async function signIn(candidate) {
  token.set(candidate);
  try {
    await call("GET", "/admin/pool"); // proves the token before anything is shown
  } catch (error) {
    token.clear();
    show(false);
    $("sign-in-error").textContent = error instanceof ApiError && [401, 403].includes(error.status)
      ? "That admin token was refused." : `Cannot sign in: ${error.message}`;
    return;
  }
  $("sign-in-error").textContent = "";
  show(true);
  const health = await fetch("/health").then((r) => r.json());
  $("server-model").textContent = `base model ${health.model}`;
  await Promise.all([refreshAdapters(), refreshModels()]);
  timer = setInterval(refreshVisible, REFRESH_SECONDS * 1000);
}

function signOut() {
  token.clear();
  clearInterval(timer);
  $("adapters-table").tBodies[0].replaceChildren();
  clearKeys();
  show(false);
}

function currentView() {
  return document.querySelector('.tab[aria-pressed="true"]').dataset.view;
}

async function refreshVisible() {
  const view = currentView();
  try {
    if (view === "adapters-view") await refreshAdapters();
    if (view === "live-view") await refreshLive();
    if (view === "keys-view") await refreshKeys();
  } catch (error) {
    if (error instanceof ApiError && [401, 403].includes(error.status)) signOut();
  }
}

function switchTo(view) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.setAttribute("aria-pressed", String(tab.dataset.view === view));
    $(tab.dataset.view).hidden = tab.dataset.view !== view;
  }
  if (view === "chat-view") refreshModels();
  refreshVisible();
}

setUpAdapters();
setUpChat();
setUpKeys();
for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => switchTo(tab.dataset.view));
$("sign-in-form").addEventListener("submit", (event) => {
  event.preventDefault();
  signIn($("token").value);
  $("token").value = "";
});
$("sign-out").addEventListener("click", signOut);
if (token.get()) signIn(token.get());
