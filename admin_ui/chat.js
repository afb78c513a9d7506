// One or two chat panes sharing one message box: compare two models on the same conversation.
import { call, streamChat } from "./api.js";
import { element } from "./format.js";

const $ = (id) => document.getElementById(id);
const histories = [[], []];

export async function refreshModels() {
  const models = (await call("GET", "/v1/models")).data.map((m) => m.id);
  for (const index of [0, 1]) {
    const select = $(`model-${index}`);
    const previous = select.value;
    select.replaceChildren(...models.map((id) => element("option", { value: id }, id)));
    select.value = models.includes(previous) ? previous : models[Math.min(index + 1, models.length - 1)];
  }
}

function activePanes() {
  return $("compare").checked ? [0, 1] : [0];
}

async function ask(index, text) {
  const pane = document.querySelector(`.pane[data-pane="${index}"]`);
  const transcript = pane.querySelector(".transcript");
  const model = $(`model-${index}`).value;
  histories[index].push({ role: "user", content: text });
  transcript.append(element("p", { className: "user" }, text));
  const reply = element("p", { className: "assistant", dataset: { model } });
  transcript.append(reply);
  let answer = "";
  try {
    for await (const piece of streamChat(model, histories[index])) {
      answer += piece;
      reply.textContent = answer;
      transcript.scrollTop = transcript.scrollHeight;
    }
    reply.classList.add("done");
    histories[index].push({ role: "assistant", content: answer });
  } catch (error) {
    histories[index].pop();
    reply.classList.add("error");
    reply.textContent = error.message;
  }
}

function clear() {
  for (const index of [0, 1]) {
    histories[index] = [];
    document.querySelector(`.pane[data-pane="${index}"] .transcript`).replaceChildren();
  }
}

export function setUpChat() {
  $("compare").addEventListener("change", (event) => {
    document.querySelector('.pane[data-pane="1"]').hidden = !event.target.checked;
  });
  for (const index of [0, 1]) $(`model-${index}`).addEventListener("change", clear);
  $("chat-clear").addEventListener("click", clear);
  $("chat-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = $("chat-message").value.trim();
    if (!text) return;
    $("chat-message").value = "";
    await Promise.all(activePanes().map((index) => ask(index, text)));
  });
  $("chat-message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
}
