// The demo page: a chat flow with one node per tool call, each opening its live detail pane.
//
// * Socket: the official Socket.IO client (socket.io-client's ES-module build, vendored in
//   kernel_ext/web/vendor and served at /vendor/): long-polling first, upgraded to WebSocket
//   when the network allows it, reconnecting with jitter; it stops after the server refuses
//   the connection or disconnects it. The indicator shows the state and the transport.
// * Language: the switch's choice (`?lang=`), else the web process's (`kernel-ext demo
//   --lang`), else the browser's (navigator.languages: the first whose primary language the
//   demo speaks, the rule of kernel_ext.demo.script.pick_lang), else config.fallback. It
//   sets the page's words, the questions, the pane's labels (renderer.js's labelsFor) and
//   the language each message asks the agent to answer in. The switch reloads the page in
//   the other language, in the same conversation.
// * Conversation: `?c=demo-…` joins that conversation (nothing is sent); without it, the page
//   starts a new conversation and sends the first question itself once joined (`?auto=0`
//   starts one without sending), and puts `?c=` in the address: a reload comes back to the
//   same conversation. Every join, a reload's and a reconnect's too, gets the conversation's
//   history (its chat_event snapshots, from the web process) and the blocks of its calls
//   (the relay's catch-up), so each pane comes back whole.
// * The flow is driven by `chat_event` snapshots: scene "message" (role user/assistant) is a
//   bubble, scene "tool" is a tool-call node (once per eventId = callId). Each node mounts
//   the renderer's pane for its callId (kernel_ext/web/renderer.js), fed by the same socket.
// * The box sends `user_message` {conversationId, text}; the web process forwards it to the
//   agent. Each running call's pane has a stop button (renderer.js's `stop` option): one
//   click sends one `stop_call` {v: 1, room, callId}; the node of a call so stopped reads
//   "stopped" (data-outcome="stopped"), and the agent answers with the other calls' results,
//   saying which colleague was stopped. Nothing else can be sent from here but
//   join_conversation.
// * All data goes into the page through textContent and attribute values; never as markup.
import { LABELS, PaneStore, attachSocket, ensureStyles, labelsFor, mountPane, stopSender } from "/renderer.js";
import { io } from "/vendor/socket.io.esm.min.js";

ensureStyles(); // the panes' stylesheet, and --kx-font, --kx-mono (the font stacks) for the whole page

const params = new URLSearchParams(location.search);
const ID_PATTERN = /^demo-[A-Za-z0-9_-]{1,64}$/;
const requested = params.get("c");
const conversationId = requested && ID_PATTERN.test(requested) ? requested : `demo-${randomId()}`;
const autoSend = requested === null && params.get("auto") !== "0";

const flow = document.getElementById("flow");
const notice = document.getElementById("notice");
const form = document.getElementById("composer");
const input = document.getElementById("message");
const sendButton = document.getElementById("send");
const connection = document.getElementById("connection");

const config = await loadConfig();
const locale = chooseLang(params.get("lang"), config.lang, navigator.languages, config.langs, config.fallback);
const current = config.langs[locale];
const labels = labelsFor(locale);
const words = current.text;
await loadFonts(JSON.stringify(config.langs) + JSON.stringify(LABELS)); // every language's words
document.documentElement.lang = current.tag;
document.title = words.title;
for (const node of document.querySelectorAll("[data-text]")) node.textContent = words[node.dataset.text];
input.placeholder = words.placeholder;
input.setAttribute("aria-label", words.placeholder);
connection.textContent = words.connecting;
const titles = new Map(current.colleagues.map((c) => [c.key, c.title]));
input.maxLength = config.maxMessageChars;
document.getElementById("tail-command").textContent =
  `kernel-ext tail --url ${location.origin} --conversation ${conversationId}` +
  (locale === "en" ? " --lang en" : "");
for (const [code, other] of Object.entries(config.langs)) {
  const choice = element("button", "lang", other.name);
  choice.type = "button";
  choice.lang = other.tag;
  choice.dataset.lang = code;
  if (code === locale) choice.setAttribute("aria-current", "true");
  choice.addEventListener("click", () => code !== locale && switchTo(code));
  document.getElementById("langs").append(choice);
}
for (const suggestion of current.suggestions) {
  const chip = element("button", "suggestion", suggestion);
  chip.type = "button";
  chip.addEventListener("click", () => {
    input.value = suggestion;
    input.focus();
  });
  document.getElementById("suggestions").append(chip);
}

const store = new PaneStore();
const socket = io("/chat");
const stop = stopSender(socket, conversationId); // the panes' stop control
const nodes = new Map(); // eventId -> tool node view
const seenMessages = new Set();
let firstSent = false;

attachSocket(socket, store, {
  conversationId,
  onJoin(ack) {
    if (!ack || ack.ok !== true) {
      showNotice(format(words.joinFailed, { id: conversationId, error: (ack && ack.error) || words.noAnswer }));
      return;
    }
    document.body.dataset.joined = "1";
    if (requested !== conversationId) {
      // A new conversation: a reload comes back to it (and does not send the question again).
      history.replaceState(null, "", addressOf({ c: conversationId }));
    }
    if (autoSend && !firstSent) {
      firstSent = true;
      send(current.firstQuestion);
    }
  },
});
socket.on("chat_event", onChatEvent);
socket.on("connect", showConnected);
socket.io.on("open", () => socket.io.engine.on("upgrade", showConnected));
// The client reconnects by itself unless the server refused or closed the connection.
socket.on("disconnect", () => setConnection("disconnected", socket.active ? words.reconnecting : words.closedByServer));
socket.on("connect_error", () => setConnection("disconnected", socket.active ? words.reconnecting : words.refused));
store.subscribe((applied) => {
  if (applied.outcome === "orphan" && applied.final) addOrphan(applied.final);
});

form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = input.value.trim();
  if (text) send(text).then((ok) => ok && (input.value = ""));
});

window.kxDemo = { store, socket, conversationId };
document.body.dataset.ready = "1";

// ---------------------------------------------------------------------------------------

async function send(message) {
  sendButton.disabled = true;
  try {
    // Sent now, or from the client's buffer once it is connected; no answer in 15 s rejects.
    const ack = await socket.timeout(15000).emitWithAck("user_message", { conversationId, text: message, lang: locale });
    if (!ack || ack.ok !== true) {
      showNotice(format(words.notTaken, { error: (ack && ack.error) || words.noAnswer }));
      return false;
    }
    notice.hidden = true;
    return true;
  } catch (error) {
    showNotice(format(words.notSent, { error: error.message }));
    return false;
  } finally {
    sendButton.disabled = false;
  }
}

function onChatEvent(event) {
  if (!event || typeof event !== "object" || typeof event.eventId !== "string") return;
  const content = event.content && typeof event.content === "object" ? event.content : {};
  if (event.eventScene === "message") {
    if (seenMessages.has(event.eventId) || typeof content.text !== "string") return;
    seenMessages.add(event.eventId);
    addMessage(content.role === "assistant" ? "assistant" : "user", content.text);
  } else if (event.eventScene === "tool") {
    if (!nodes.has(event.eventId)) nodes.set(event.eventId, addToolNode(event.eventId, content));
  }
}

function addMessage(role, message) {
  const item = element("li", "node node-message");
  item.dataset.role = role;
  const bubble = element("div", "bubble");
  bubble.append(element("span", "who", role === "assistant" ? words.agent : words.you), document.createTextNode(message));
  item.append(bubble);
  append(item);
}

function addToolNode(callId, content) {
  const call = content.toolCall && typeof content.toolCall === "object" ? content.toolCall : {};
  const fn = call.functionCall && typeof call.functionCall === "object" ? call.functionCall : {};
  const args = fn.arguments && typeof fn.arguments === "object" ? fn.arguments : {};
  const name = typeof fn.name === "string" ? fn.name : typeof call.toolId === "string" ? call.toolId : "tool";
  const colleague = typeof args.colleague === "string" ? titles.get(args.colleague) || args.colleague : null;

  const item = element("li", "node node-tool");
  item.dataset.callId = callId;
  const head = element("button", "node-head");
  head.type = "button";
  head.setAttribute("aria-expanded", "true");
  const state = element("span", "node-state");
  head.append(element("span", "node-icon", "⚙"), element("span", "node-title", name));
  if (colleague) head.append(element("span", "node-arg", `→ ${colleague}`));
  head.append(state, element("span", "chevron", "▾"));
  const detail = element("div", "node-detail");
  item.append(head, detail);
  head.addEventListener("click", () => {
    const open = head.getAttribute("aria-expanded") !== "true";
    head.setAttribute("aria-expanded", String(open));
    detail.hidden = !open;
  });
  append(item);
  const pane = mountPane(detail, store, callId, { locale, stop });
  const update = () => {
    const current = store.pane(callId);
    const status = current ? current.status : "calling";
    // An ended call the person stopped reads "stopped" (已停止), not "ended": its last terminal says so.
    const stopped = status === "ended" && current.final !== null && current.final.from === "stopped";
    item.dataset.status = status;
    item.dataset.outcome = stopped ? "stopped" : "";
    state.textContent = stopped
      ? labels.stopped
      : { calling: labels.calling, streaming: labels.streaming, ended: labels.ended, no_details: labels.noDetails }[status];
  };
  const unsubscribe = store.subscribe((applied) => applied.callId === callId && update());
  update();
  return { item, pane, unsubscribe };
}

function addOrphan(final) {
  const item = element("li", "node node-message node-orphan");
  item.dataset.role = "assistant";
  const bubble = element("div", "bubble");
  const word = final.from === "aborted" ? labels.aborted : labels.final;
  bubble.append(element("span", "who", `${labels.unattributed} · ${word}`), document.createTextNode(final.text));
  item.append(bubble);
  append(item);
}

function append(item) {
  const follow = window.innerHeight + window.scrollY >= document.body.scrollHeight - 40;
  flow.append(item);
  if (follow) item.scrollIntoView({ block: "end" });
}

function showNotice(message) {
  notice.textContent = message;
  notice.hidden = false;
}

function setConnection(state, label, transport = "") {
  connection.dataset.state = state;
  connection.dataset.transport = transport;
  connection.textContent = transport ? `${label} · ${transport}` : label;
}

function showConnected() {
  if (socket.connected) setConnection("connected", words.connected, socket.io.engine.transport.name);
}

// Loads the page's web faces (app.css's CJK subset) that `text` needs before any of it is
// laid out: Chromium keeps a form control (the switch's "中文") laid out in fallback boxes
// while its face loads. Given every language's words, it loads the face whatever the page's
// language; a face that fails to load leaves the machine's fonts.
async function loadFonts(text) {
  try {
    await document.fonts.load(`14px ${getComputedStyle(document.body).fontFamily}`, text);
  } catch {
    // the machine's fonts, then
  }
}

// The demo's language for this page: `chosen` (the switch's), else `forced` (--lang), else
// the first of `preferences` whose primary language is one of `langs`, else `fallback`.
function chooseLang(chosen, forced, preferences, langs, fallback) {
  for (const code of [chosen, forced]) if (code && Object.hasOwn(langs, code)) return code;
  for (const tag of preferences || []) {
    const primary = String(tag).trim().split(/[-_.@]/)[0].toLowerCase();
    if (Object.hasOwn(langs, primary)) return primary;
  }
  return fallback;
}

// The page in language `code`: the same conversation (not sent again) once it has started.
function switchTo(code) {
  const started = firstSent || requested !== null || document.body.dataset.joined === "1";
  location.assign(addressOf(started ? { c: conversationId, lang: code } : { lang: code }));
}

// An address of this page: conversation `c` (then auto= no longer matters) and language
// `lang` (default: this page's ?lang=, if any).
function addressOf({ c, lang }) {
  const query = new URLSearchParams();
  if (c) query.set("c", c);
  else if (params.has("auto")) query.set("auto", params.get("auto"));
  const language = lang || params.get("lang");
  if (language) query.set("lang", language);
  return `?${query}`;
}

// Fills {name} placeholders of the page's words (plain text; the result goes in as text).
function format(template, values) {
  return template.replace(/\{(\w+)\}/g, (whole, name) => (Object.hasOwn(values, name) ? String(values[name]) : whole));
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function randomId() {
  const bytes = new Uint8Array(6);
  crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

async function loadConfig() {
  const response = await fetch("/demo/config.json", { cache: "no-store" });
  if (!response.ok) throw new Error(`config: HTTP ${response.status}`);
  return response.json();
}
