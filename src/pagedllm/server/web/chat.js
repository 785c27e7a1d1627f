// The chat view: conversations kept in this browser (localStorage), answers streamed from
// /v1/chat/completions, a stop button that aborts the request (the server frees it when the
// connection closes), and per answer: time to first token, tokens/s, cached prompt tokens,
// and the queue position while it waits.

import { call, events } from "./api.js";
import { copyButton, render } from "./markdown.js";

const STORE = "pagedllm-conversations";
const MODEL_KEY = "pagedllm-chat-model";
const $ = (id) => document.getElementById(id);

let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = null;
let controller = null;

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
}

function newConversation() {
  current = { id: Date.now().toString(36), title: "New chat", messages: [] };
  conversations.unshift(current);
  save();
  showConversations();
  showMessages();
}

function showConversations() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const conversation of conversations) {
    const item = document.createElement("li");
    item.textContent = conversation.title;
    item.className = conversation === current ? "active" : "";
    item.addEventListener("click", () => {
      current = conversation;
      showConversations();
      showMessages();
    });
    list.append(item);
  }
}

function messageElement(role, text, meta = "") {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "body";
  if (role === "assistant") render(body, text);
  else body.textContent = text;
  element.append(body);
  const footer = document.createElement("div");
  footer.className = "meta";
  const info = document.createElement("span");
  info.textContent = meta;
  footer.append(info);
  if (role === "assistant") footer.append(copyButton(() => element.dataset.text || ""));
  element.dataset.text = text;
  element.append(footer);
  $("messages").append(element);
  element.scrollIntoView({ block: "end" });
  return { element, body, info };
}

function showMessages() {
  $("messages").replaceChildren();
  for (const message of current.messages) messageElement(message.role, message.content, message.meta || "");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  if (!current) newConversation();
  if (current.messages.length === 0) {
    current.title = text.slice(0, 40);
    showConversations();
  }
  current.messages.push({ role: "user", content: text });
  messageElement("user", text);
  const system = $("system-prompt").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(
    current.messages.map(({ role, content }) => ({ role, content })));
  const view = messageElement("assistant", "", "waiting…");
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let text_ = "", firstToken = null, tokens = 0, usage = null, ended = "";
  try {
    const response = await call("/v1/chat/completions", {
      method: "POST", signal: controller.signal, headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: $("chat-model").value || undefined, messages, stream: true, stream_options: { include_usage: true },
                             queue_position: true, temperature: Number($("temperature").value),
                             max_tokens: Number($("max-tokens").value) }),
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error(error.error?.message || `HTTP ${response.status}`);
    }
    for await (const event of events(response)) {
      if (event === "[DONE]") break;
      if (event.error) throw new Error(event.error.message);
      if (event.object === "queue.position") {
        view.info.textContent = `queued: position ${event.queue_position} of ${event.queue_length}`;
        continue;
      }
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const piece = choice.delta?.content;
        if (piece) {
          if (firstToken === null) firstToken = performance.now();
          tokens += 1;
          text_ += piece;
          render(view.body, text_);
          view.element.dataset.text = text_;
        }
        if (choice.finish_reason) ended = choice.finish_reason;
      }
    }
  } catch (error) {
    ended = error.name === "AbortError" ? "stopped" : `error: ${error.message}`;
  } finally {
    controller = null;
    setBusy(false);
  }
  const now = performance.now();
  const parts = [];
  if (firstToken !== null) parts.push(`TTFT ${Math.round(firstToken - started)} ms`);
  const generated = usage?.completion_tokens ?? tokens;
  if (firstToken !== null && now > firstToken) parts.push(`${(generated / ((now - firstToken) / 1000)).toFixed(1)} tok/s`);
  if (usage) parts.push(`${usage.prompt_tokens_details?.cached_tokens ?? 0} of ${usage.prompt_tokens} prompt tokens cached`);
  if (ended) parts.push(ended === "stopped" || ended.startsWith("error") ? ended : `finished: ${ended}`);
  const meta = parts.join(" · ");
  view.info.textContent = meta;
  current.messages.push({ role: "assistant", content: text_, meta });
  save();
}

// The model picker: every chat model the server serves (a store's, loaded or not: the first
// message to one loads it), the last one picked remembered in this browser.
function showModels(models) {
  const select = $("chat-model");
  const kept = localStorage.getItem(MODEL_KEY);
  select.replaceChildren(...models.map((id) => {
    const option = document.createElement("option");
    option.value = option.textContent = id;
    option.selected = id === kept;
    return option;
  }));
  select.addEventListener("change", () => localStorage.setItem(MODEL_KEY, select.value));
}

export function startChat(models = []) {
  showModels(models);
  if (conversations.length) current = conversations[0];
  else newConversation();
  showConversations();
  showMessages();
  $("new-chat").addEventListener("click", newConversation);
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
}
