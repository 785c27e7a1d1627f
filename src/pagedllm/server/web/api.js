// The server's API as the page uses it: the key kept in session storage, asked for once
// when the server answers 401, and server-sent events read from fetch (EventSource cannot
// send an Authorization header).

const KEY_NAME = "pagedllm-api-key";

export function apiKey() {
  return sessionStorage.getItem(KEY_NAME);
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// Shows the key dialog until the server accepts a key (checked against /v1/models).
export async function askForKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  const error = document.getElementById("key-error");
  error.hidden = !message;
  error.textContent = message || "";
  input.value = "";
  dialog.showModal();
  await new Promise((resolve) => dialog.addEventListener("close", resolve, { once: true }));
  sessionStorage.setItem(KEY_NAME, input.value.trim());
  const check = await fetch("/v1/models", { headers: headers() });
  if (check.status === 401) {
    sessionStorage.removeItem(KEY_NAME);
    return askForKey("The server refused that key.");
  }
}

// fetch with the key; on 401 asks for a key once and tries again.
export async function call(path, options = {}) {
  let response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (response.status === 401) {
    await askForKey(apiKey() ? "The server refused the key." : "");
    response = await fetch(path, { ...options, headers: headers(options.headers) });
  }
  return response;
}

// Yields each `data:` payload of a server-sent event stream (parsed JSON, or "[DONE]").
export async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        yield data === "[DONE]" ? data : JSON.parse(data);
      }
    }
  }
}
