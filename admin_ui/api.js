// The server's HTTP API with the admin token; the token lives in sessionStorage only.
const TOKEN_KEY = "loraserve-admin-token";

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(extra = {}) {
  return { Authorization: `Bearer ${token.get()}`, ...extra };
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body.error?.message ?? message;
  } catch (_) { /* not JSON: keep the status line */ }
  return new ApiError(response.status, message);
}

export async function call(method, path, body) {
  const init = { method, headers: headers() };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await errorOf(response);
  const type = response.headers.get("content-type") ?? "";
  return type.includes("json") ? response.json() : response.text();
}

// Runs an admin action, shows its error (if any) in `errorNode`, then refreshes the view either way.
export async function actThenRefresh(action, errorNode, refresh) {
  try {
    await action();
  } catch (error) {
    errorNode.textContent = error.message;
  }
  await refresh();
}

// XMLHttpRequest, not fetch: only it reports upload progress. `replace`: PUT new weights for the adapter `replace`.
export function upload(formData, onProgress, replace = null) {
  return new Promise((resolve, reject) => {
    const request = new XMLHttpRequest();
    if (replace) request.open("PUT", `/admin/adapters/${encodeURIComponent(replace)}`);
    else request.open("POST", "/admin/adapters");
    request.setRequestHeader("Authorization", `Bearer ${token.get()}`);
    request.upload.onprogress = (event) => event.lengthComputable && onProgress(event.loaded / event.total);
    request.onload = () => {
      let body = null;
      try { body = JSON.parse(request.responseText); } catch (_) { /* plain text error */ }
      if (request.status === (replace ? 200 : 201)) resolve(body);
      else reject(new ApiError(request.status, body?.error?.message ?? `${request.status} ${request.statusText}`));
    };
    request.onerror = () => reject(new ApiError(0, "the server could not be reached"));
    request.send(formData);
  });
}

// Yields each content delta of a streamed chat completion.
export async function* streamChat(model, messages, maxTokens = 256) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ model, messages, max_tokens: maxTokens, temperature: 0, stream: true }),
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") return;
      for (const choice of JSON.parse(data).choices) {
        if (choice.delta?.content) yield choice.delta.content;
      }
    }
  }
}
