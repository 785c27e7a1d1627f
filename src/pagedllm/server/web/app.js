// The page: two views (chat, server), the API key asked for once when the server needs one.

import { call } from "./api.js";
import { startChat } from "./chat.js";
import { liveState, startLive } from "./live.js";

const views = { chat: document.getElementById("view-chat"), server: document.getElementById("view-server") };
let liveStarted = false;

function show(name) {
  for (const [key, element] of Object.entries(views)) element.hidden = key !== name;
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === name);
  if (name === "server" && !liveStarted) {
    liveStarted = true; // the state stream runs only once someone looks at it
    startLive();
  }
  history.replaceState(null, "", name === "chat" ? "/" : `/#${name}`);
}

async function main() {
  // Asks for a key here, once, when the server has keys (401).
  const models = await call("/v1/models");
  let chatModels = [];
  if (models.ok) {
    chatModels = (await models.json()).data.filter((m) => m.kind !== "embedding").map((m) => m.id);
    document.getElementById("model-name").textContent = chatModels[0] || "";
  }
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
  startChat(chatModels);
  show(location.hash === "#server" ? "server" : "chat");
  window.pagedllm = { liveState }; // for tests and the curious: snapshots seen, the latest one
  document.body.dataset.ready = "true";
}

main();
