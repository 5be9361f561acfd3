// kernel_ext detail-pane renderer: the tool_event_stream rendering semantics for browsers.
//
// (About 790 lines in one file on purpose: pages import it as one ES module with no build
// step, and the store and its DOM view change together.)
//
// An ES module with no dependencies and no build step. Two parts:
//
//   * PaneStore — applies the spec's semantics (group by callId, order each task's blocks by
//     envelope.seq, drop a repeated seq, pin the terminal's final answer, stop appending
//     after it, "no process details" after a timeout, the pane's mode "replay" while a join
//     catches up and "live" afterwards, what the relay could no longer send) and exposes the
//     state in the format of the conformance vectors (tests/vectors/README.md). Same
//     semantics as kernel_ext/viewing/view.py.
//   * mountPane / mountRoom — DOM views of that state. Every peer-supplied string goes into
//     the page through textContent or an attribute value; this module never parses data as
//     HTML and uses no HTML-string sink at all (tests/js/renderer.test.mjs checks the source).
//
// Usage with a Socket.IO client (namespace /chat):
//
//   import { PaneStore, mountRoom, attachSocket } from "/static/renderer.js";
//   const store = new PaneStore();
//   mountRoom(document.getElementById("panes"), store);          // or mountPane(el, store, callId)
//   attachSocket(io("/chat", { auth: { token } }), store, { conversationId: "conv-1" });

export const DEFAULT_TIMEOUT_MS = 15000;

/** How long attachSocket waits for the join's acknowledgement before it gives up on it. */
export const DEFAULT_JOIN_TIMEOUT_MS = 10000;

/**
 * A join names at most this many streams: the cursors of `have` (the relay reads no more)
 * and the entries of the acknowledgement's `replay.missing` that are read. Same as
 * view.MAX_JOIN_STREAMS.
 */
export const MAX_JOIN_STREAMS = 1000;

/** How long a stop request (stopSender) waits for the relay's answer before it has failed. */
export const DEFAULT_STOP_TIMEOUT_MS = 10000;

/**
 * The relay's answers to `stop_call` (docs/web.md, "Stopping a call"): the worker was asked
 * (its terminal follows), the call had ended, no running call with that callId in that
 * room, not allowed, no worker reachable. Same as kernel_ext.protocol.STOP_ANSWERS.
 */
export const STOP_ANSWERS = Object.freeze(["stopping", "already_ended", "unknown", "refused", "unreachable"]);

// The longest `reason` of a stop's answer a pane shows, in UTF-16 code units (then "…").
const MAX_REASON_CHARS = 200;

// Counts and cursors are JSON integers every reader holds exactly: 0 .. 2**53 - 1.
const MAX_COUNT = Number.MAX_SAFE_INTEGER;

/** The pane's words: the spec's Chinese by default, English available. Same as view.LABELS. */
export const LABELS = Object.freeze({
  zh: Object.freeze({
    calling: "调用中…",
    streaming: "进行中",
    ended: "已结束",
    noDetails: "无过程详情",
    thinking: "思考中…",
    toolStart: "开始",
    final: "最终回复",
    aborted: "已中止",
    stopped: "已停止",
    task: "任务",
    unknownKind: "未知类型",
    unattributed: "未关联调用",
    replay: "同步中…",
    live: "实时",
    missing: "{n} 条较早的内容已不可用",
    missingOne: "1 条较早的内容已不可用",
    stop: "停止",
    stopCall: "停止这次调用",
    stopping: "正在停止…",
    stopAlreadyEnded: "调用已经结束",
    stopUnknown: "未知的调用",
    stopRefused: "你无权停止这次调用",
    stopUnreachable: "无法联系到执行调用的进程",
    stopOffline: "未连接：停止请求没有发出",
    stopFailed: "停止请求没有得到可用的回应",
  }),
  en: Object.freeze({
    calling: "Calling…",
    streaming: "Running",
    ended: "Ended",
    noDetails: "No process details",
    thinking: "Thinking…",
    toolStart: "started",
    final: "Final answer",
    aborted: "Aborted",
    stopped: "Stopped",
    task: "Task",
    unknownKind: "Unknown kind",
    unattributed: "Unattributed call",
    replay: "Catching up…",
    live: "Live",
    missing: "{n} earlier blocks are no longer available",
    missingOne: "1 earlier block is no longer available",
    stop: "Stop",
    stopCall: "Stop this call",
    stopping: "Stopping…",
    stopAlreadyEnded: "The call had already ended",
    stopUnknown: "Unknown call",
    stopRefused: "You may not stop this call",
    stopUnreachable: "No worker reachable",
    stopOffline: "Not connected: the stop was not sent",
    stopFailed: "No usable answer to the stop request",
  }),
});

/** The label set for `locale` ("zh" or "en"; anything else gets "zh"), with `overrides` on top. */
export function labelsFor(locale = "zh", overrides = undefined) {
  const base = Object.prototype.hasOwnProperty.call(LABELS, locale) ? LABELS[locale] : LABELS.zh;
  return Object.freeze({ ...base, ...(overrides || {}) });
}

const STATES = new Set(["running", "done", "aborted"]);
const TEXT_KINDS = new Set(["thinking", "text", "tool_output_append"]);
const TOOL_NAME_KEYS = ["name", "tool", "toolName"];
const DROP_REASONS = ["invalid", "duplicate", "afterEnd", "unattributed", "ignoredSnapshot", "ignoredAck"];

function isObject(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}

function has(object, key) {
  return Object.prototype.hasOwnProperty.call(object, key);
}

function get(object, key) {
  return has(object, key) ? object[key] : undefined;
}

function nonEmptyString(value) {
  return typeof value === "string" && value !== "";
}

function strOrNull(value) {
  return typeof value === "string" ? value : null;
}

function numberOrNull(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}

// A2A data parts carry every number as a float: 3.0 is accepted as 3 (in JS they are equal).
function seqOf(value) {
  if (typeof value !== "number" || !Number.isInteger(value) || value < 0) return null;
  return value === 0 ? 0 : value; // -0 → 0
}

// A block count of the acknowledgement: an integer 1 .. 2**53 - 1, else null.
function countOf(value) {
  return Number.isSafeInteger(value) && value > 0 ? value : null;
}

// The W3C forms of the ids a span link is built from (protocol: callId, traceId).
const SPAN_ID = /^[0-9a-f]{16}$/;
const TRACE_ID = /^[0-9a-f]{32}$/;
const NO_TRACE_ID = "0".repeat(32);

function traceIdOf(value) {
  return typeof value === "string" && TRACE_ID.test(value) && value !== NO_TRACE_ID ? value : null;
}

/**
 * The address of a call's span in a trace backend: `template` with `{traceId}` and
 * `{spanId}` replaced by the ids (URI-encoded), or null — when the template is not a
 * string, the trace id is not 32 lower-case hex digits (all zeros is none), the span id
 * (the callId) not 16, or the result is not an absolute http: or https: URL.
 */
export function traceUrl(template, traceId, spanId) {
  if (typeof template !== "string" || traceIdOf(traceId) === null) return null;
  if (typeof spanId !== "string" || !SPAN_ID.test(spanId)) return null;
  const filled = template
    .split("{traceId}")
    .join(encodeURIComponent(traceId))
    .split("{spanId}")
    .join(encodeURIComponent(spanId));
  let url;
  try {
    url = new URL(filled);
  } catch {
    return null;
  }
  return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
}

// One key per stream; "" stands for callId null (a callId is never empty).
function streamKey(callId, taskId) {
  return `${callId === null ? "" : callId}\n${taskId}`;
}

/** The words of the notice for `count` blocks a task lacks for good. */
export function missingText(labels, count) {
  return count === 1 ? labels.missingOne : labels.missing.split("{n}").join(String(count));
}

function parseBlock(block) {
  if (!isObject(block) || !has(block, "callId")) return null;
  const callId = block.callId;
  if (!(callId === null || (typeof callId === "string" && callId !== ""))) return null;
  const taskId = get(block, "taskId");
  const state = get(block, "state");
  const envelope = get(block, "envelope");
  if (typeof taskId !== "string" || taskId === "" || !STATES.has(state) || !isObject(envelope)) {
    return null;
  }
  const kind = get(envelope, "kind");
  const seq = seqOf(get(envelope, "seq"));
  if (typeof kind !== "string" || kind === "" || seq === null) return null;
  const payload = isObject(get(envelope, "payload")) ? envelope.payload : {};
  const traceId = callId === null ? null : traceIdOf(get(block, "traceId"));
  return { callId, taskId, state, kind, seq, payload, traceId };
}

function itemOf(parsed) {
  const { kind, seq, payload } = parsed;
  if (TEXT_KINDS.has(kind)) {
    return Object.freeze({ kind, seq, text: strOrNull(get(payload, "text")) || "" });
  }
  if (kind === "tool_call") {
    let tool = null;
    for (const key of TOOL_NAME_KEYS) {
      if (typeof get(payload, key) === "string") {
        tool = payload[key];
        break;
      }
    }
    return Object.freeze({ kind, seq, tool });
  }
  if (kind === "progress") {
    const message = strOrNull(get(payload, "message"));
    return Object.freeze({
      kind,
      seq,
      progress: numberOrNull(get(payload, "progress")),
      total: numberOrNull(get(payload, "total")),
      text: message !== null ? message : strOrNull(get(payload, "text")),
    });
  }
  return Object.freeze({ kind: "other", seq, envelopeKind: kind, text: strOrNull(get(payload, "text")) });
}

function itemJson(item) {
  switch (item.kind) {
    case "thinking":
      return { kind: "thinking", seq: item.seq, text: item.text, folded: true };
    case "tool_call":
      return { kind: "tool_call", seq: item.seq, tool: item.tool };
    case "progress":
      return { kind: "progress", seq: item.seq, progress: item.progress, total: item.total, text: item.text };
    case "other":
      return { kind: "other", envelopeKind: item.envelopeKind, seq: item.seq, text: item.text };
    default:
      return { kind: item.kind, seq: item.seq, text: item.text };
  }
}

function terminalText(parsed) {
  return strOrNull(get(parsed.payload, parsed.state === "done" ? "text" : "message")) || "";
}

/** How a terminal ended: "done", "stopped" (aborted, payload.stopped true: the user stopped
 * the call) or "aborted" (failed). Same as view._outcome. */
function outcomeOf(parsed) {
  if (parsed.state === "done") return "done";
  return get(parsed.payload, "stopped") === true ? "stopped" : "aborted";
}

/** The words of a final answer's label, by where it is from. */
function finalLabel(labels, from) {
  if (from === "aborted") return labels.aborted;
  if (from === "stopped") return labels.stopped;
  return labels.final;
}

function toolOf(content) {
  const toolCall = get(content, "toolCall");
  if (!isObject(toolCall)) return null;
  const functionCall = get(toolCall, "functionCall");
  if (isObject(functionCall) && typeof get(functionCall, "name") === "string") {
    return functionCall.name;
  }
  for (const key of ["toolId", "name"]) {
    if (typeof get(toolCall, key) === "string") return toolCall[key];
  }
  return null;
}

function returnText(value) {
  if (typeof value === "string") return value;
  if (isObject(value)) {
    for (const key of ["text", "content"]) {
      if (typeof get(value, key) === "string") return value[key];
    }
  }
  return null;
}

/** One stream of a pane: the blocks of one (callId, taskId), ordered by seq. */
export class Task {
  constructor(taskId) {
    this.taskId = taskId;
    this.items = [];
    this.outcome = null; // "done" | "aborted" | "stopped" once the terminal arrived
    this.final = null;
    this.terminalSeq = null;
    this.missing = 0; // blocks the relay could no longer send (replay.missing of the acks)
    this.gapAfter = null; // where they belong: after this seq (-1: before every item)
  }

  get ended() {
    return this.outcome !== null;
  }

  /** The highest seq this task holds, its items' and its terminal's. */
  get lastSeq() {
    const last = this.items.length > 0 ? this.items[this.items.length - 1].seq : -1;
    return Math.max(last, this.terminalSeq === null ? -1 : this.terminalSeq);
  }

  /** Insert in seq order; false (and no change) when that seq is already present. */
  insert(item) {
    const items = this.items;
    let lo = 0;
    let hi = items.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (items[mid].seq < item.seq) lo = mid + 1;
      else hi = mid;
    }
    if (lo < items.length && items[lo].seq === item.seq) return false;
    items.splice(lo, 0, item);
    return true;
  }

  toJSON() {
    return {
      taskId: this.taskId,
      ended: this.ended,
      outcome: this.outcome,
      final: this.final,
      missing: this.missing,
      items: this.items.map(itemJson),
    };
  }
}

/** The detail pane of one tool call. */
export class Pane {
  constructor(callId, openedAt) {
    this.callId = callId;
    this.traceId = null; // from the first block applied to the pane that carries one
    this.openedAt = openedAt;
    this.mode = "live"; // "replay" while a join catches up (PaneStore.beginReplay)
    this.tool = null;
    this.returned = false;
    this.returnText = null;
    this.timedOut = false;
    this.tasks = new Map();
    this.lastFinal = null;
  }

  /** Keep `traceId` (valid or null) when the pane has none yet: the first one stays. */
  takeTraceId(traceId) {
    if (this.traceId === null) this.traceId = traceId;
  }

  /** "streaming" | "ended" | "no_details" | "calling" (see tests/vectors/README.md). */
  get status() {
    if (this.tasks.size > 0) {
      for (const task of this.tasks.values()) if (!task.ended) return "streaming";
      return "ended";
    }
    return this.returned || this.timedOut ? "no_details" : "calling";
  }

  /** The pinned final answer: the latest terminal's, else the tool's return text, else null. */
  get final() {
    if (this.lastFinal !== null) return this.lastFinal;
    if (this.returnText !== null) return { from: "toolReturn", taskId: null, text: this.returnText };
    return null;
  }

  toJSON() {
    const final = this.final;
    return {
      callId: this.callId,
      traceId: this.traceId,
      mode: this.mode,
      tool: this.tool,
      status: this.status,
      returned: this.returned,
      final: final === null ? null : { from: final.from, taskId: final.taskId, text: final.text },
      tasks: Array.from(this.tasks.values(), (task) => task.toJSON()),
    };
  }
}

/**
 * All detail panes of one conversation room, fed with what the socket delivers.
 *
 * applyBlock / applySnapshot take the parsed JSON of `tool_event_stream` / `chat_event`
 * messages in arrival order and never throw on bad input (it is dropped and counted);
 * tick() lets panes without blocks reach "no process details". Catch-up: beginReplay()
 * when `join_conversation` is sent (it returns the `have` cursors to send), endReplay(ack)
 * when its acknowledgement arrives or the join failed. `clock` returns milliseconds on any
 * monotonic scale (default Date.now). Listeners (subscribe) get the result of every input:
 * {outcome, callId, taskId, item, final, newPane, newTask}; outcome "mode" when a pane's
 * mode changed, "missing" when a task learnt of blocks it will never get.
 */
export class PaneStore {
  constructor({ timeoutMs = DEFAULT_TIMEOUT_MS, clock = () => Date.now() } = {}) {
    if (!(typeof timeoutMs === "number" && timeoutMs >= 0)) {
      throw new RangeError(`timeoutMs must be a number >= 0, got ${String(timeoutMs)}`);
    }
    this.timeoutMs = timeoutMs;
    this.clock = clock;
    this._panes = new Map();
    this._orphans = new Map();
    this._listeners = new Set();
    this._replaying = false;
    this._joinCursors = new Map();
    this.dropped = Object.fromEntries(DROP_REASONS.map((reason) => [reason, 0]));
  }

  /** Whether a join is being caught up (between beginReplay and endReplay). */
  get replaying() {
    return this._replaying;
  }

  /** The panes in order of first appearance. */
  get panes() {
    return Array.from(this._panes.values());
  }

  /** The pane of `callId`, or null. */
  pane(callId) {
    return this._panes.get(callId) || null;
  }

  /** Final answers of terminal blocks with callId null, one per taskId: {taskId, outcome, text, seq}. */
  get orphans() {
    return Array.from(this._orphans.values());
  }

  /** The whole room in the vector format (plain JSON data). */
  state() {
    return {
      panes: this.panes.map((pane) => pane.toJSON()),
      orphans: this.orphans.map((o) => ({ taskId: o.taskId, outcome: o.outcome, text: o.text })),
      dropped: { ...this.dropped },
    };
  }

  /** Call `listener(applied)` after every input; returns a function that unsubscribes. */
  subscribe(listener) {
    this._listeners.add(listener);
    return () => this._listeners.delete(listener);
  }

  _emit(applied) {
    for (const listener of Array.from(this._listeners)) {
      try {
        listener(applied);
      } catch (error) {
        // A faulty view must not break the store or the other views.
        console.error("kernel_ext renderer: listener failed", error);
      }
    }
    return applied;
  }

  _result(outcome, fields = {}) {
    return this._emit({
      outcome,
      callId: null,
      taskId: null,
      item: null,
      final: null,
      newPane: false,
      newTask: false,
      ...fields,
    });
  }

  _drop(reason, fields = {}) {
    this.dropped[reason] += 1;
    return this._result(reason, fields);
  }

  _open(callId) {
    let pane = this._panes.get(callId);
    if (pane) return [pane, false];
    pane = new Pane(callId, this.clock());
    if (this._replaying) pane.mode = "replay";
    this._panes.set(callId, pane);
    return [pane, true];
  }

  /** Apply one `tool_event_stream` block (the JSON object as received). */
  applyBlock(block) {
    const parsed = parseBlock(block);
    if (parsed === null) return this._drop("invalid");
    const { callId, taskId } = parsed;
    const terminal = parsed.state !== "running";
    if (callId === null) {
      if (!terminal) return this._drop("unattributed", { taskId });
      if (this._orphans.has(taskId)) return this._drop("afterEnd", { taskId });
      const text = terminalText(parsed);
      const orphan = Object.freeze({ taskId, outcome: outcomeOf(parsed), text, seq: parsed.seq });
      this._orphans.set(taskId, orphan);
      const final = { from: orphan.outcome, taskId, text: orphan.text };
      return this._result("orphan", { taskId, final });
    }
    const [pane, newPane] = this._open(callId);
    let task = pane.tasks.get(taskId);
    const newTask = task === undefined;
    if (newTask) {
      task = new Task(taskId);
      pane.tasks.set(taskId, task);
    } else if (task.ended) {
      return this._drop("afterEnd", { callId, taskId });
    }
    if (terminal) {
      pane.takeTraceId(parsed.traceId);
      task.outcome = outcomeOf(parsed);
      task.final = terminalText(parsed);
      task.terminalSeq = parsed.seq;
      pane.lastFinal = Object.freeze({ from: task.outcome, taskId, text: task.final });
      return this._result("terminal", { callId, taskId, final: pane.lastFinal, newPane, newTask });
    }
    const item = itemOf(parsed);
    if (!task.insert(item)) return this._drop("duplicate", { callId, taskId });
    pane.takeTraceId(parsed.traceId);
    return this._result("item", { callId, taskId, item, newPane, newTask });
  }

  /**
   * Apply one `chat_event` tool-event snapshot (the JSON object as received): eventId is the
   * callId; eventScene, when present, must be "tool"; content.toolCall names the tool and a
   * non-null content.toolReturn marks the tool as returned (its text: the value itself if a
   * string, else its string `text` or `content`).
   */
  applySnapshot(event) {
    if (!isObject(event)) return this._drop("ignoredSnapshot");
    const callId = get(event, "eventId");
    const scene = has(event, "eventScene") ? event.eventScene : "tool";
    if (typeof callId !== "string" || callId === "" || scene !== "tool") {
      return this._drop("ignoredSnapshot");
    }
    const content = isObject(get(event, "content")) ? event.content : {};
    const [pane, newPane] = this._open(callId);
    const tool = toolOf(content);
    if (tool !== null) pane.tool = tool;
    let final = null;
    const toolReturn = get(content, "toolReturn");
    if (toolReturn !== undefined && toolReturn !== null) {
      pane.returned = true;
      const text = returnText(toolReturn);
      if (text !== null) {
        pane.returnText = text;
        final = pane.final;
      }
    }
    return this._result("snapshot", { callId, final, newPane });
  }

  /**
   * The join request's `have`: per stream this store holds, the highest seq it holds (its
   * items' and its terminal's), as [{callId, taskId, seq}] — open streams first (in order of
   * pane and task), then ended ones, then the final answers of calls without a callId
   * (callId null); at most MAX_JOIN_STREAMS entries, and none for a seq above 2**53 - 1.
   */
  have() {
    const open = [];
    const ended = [];
    for (const pane of this._panes.values()) {
      for (const task of pane.tasks.values()) {
        if (task.ended) ended.push({ callId: pane.callId, taskId: task.taskId, seq: task.lastSeq, ended: true });
        else open.push({ callId: pane.callId, taskId: task.taskId, seq: task.lastSeq });
      }
    }
    const orphans = Array.from(this._orphans.values(), (o) => ({ callId: null, taskId: o.taskId, seq: o.seq, ended: true }));
    const cursors = [...open, ...ended, ...orphans].filter((cursor) => cursor.seq <= MAX_COUNT);
    return cursors.slice(0, MAX_JOIN_STREAMS);
  }

  /**
   * A join is being sent: every pane, and every pane opened until endReplay, is in mode
   * "replay". Returns the cursors to send as the join's `have` (see have()).
   */
  beginReplay() {
    const have = this.have();
    this._joinCursors = new Map(have.map((cursor) => [streamKey(cursor.callId, cursor.taskId), cursor.seq]));
    this._replaying = true;
    for (const pane of this._panes.values()) {
      if (pane.mode === "replay") continue;
      pane.mode = "replay";
      this._result("mode", { callId: pane.callId });
    }
    return have;
  }

  /**
   * The join's acknowledgement arrived (`ack` as received), or the join failed (`ack` null
   * or undefined: no answer; `{ok: false, …}`: refused): every pane is "live" again. An
   * accepted join's `replay.missing` entries ({callId, taskId, blocks}) add `blocks` to the
   * missing count of their task (at most 2**53 - 1 in all). What cannot be used is counted
   * in dropped.ignoredAck, never thrown: an ack that is not an object with a boolean `ok`;
   * a `replay` or `missing` of the wrong type; an entry that is not such an object with a
   * non-empty string callId and taskId and an integer `blocks` of 1 .. 2**53 - 1, or that is
   * for a stream this store does not hold; entries past the first MAX_JOIN_STREAMS. Returns
   * the results it reported to the listeners ("missing", then "mode").
   */
  endReplay(ack) {
    const cursors = this._joinCursors;
    this._joinCursors = new Map();
    this._replaying = false;
    const results = [];
    if (isObject(ack) && typeof get(ack, "ok") === "boolean") {
      const replay = get(ack, "replay");
      if (ack.ok && replay !== undefined && replay !== null) this._applyMissing(replay, cursors, results);
    } else if (ack !== null && ack !== undefined) {
      this.dropped.ignoredAck += 1;
    }
    for (const pane of this._panes.values()) {
      if (pane.mode === "live") continue;
      pane.mode = "live";
      results.push(this._result("mode", { callId: pane.callId }));
    }
    return results;
  }

  _applyMissing(replay, cursors, results) {
    if (!isObject(replay)) {
      this.dropped.ignoredAck += 1;
      return;
    }
    const missing = get(replay, "missing");
    if (missing === undefined || missing === null) return;
    if (!Array.isArray(missing)) {
      this.dropped.ignoredAck += 1;
      return;
    }
    const read = Math.min(missing.length, MAX_JOIN_STREAMS);
    this.dropped.ignoredAck += missing.length - read;
    for (let index = 0; index < read; index += 1) {
      const entry = missing[index];
      const callId = isObject(entry) ? get(entry, "callId") : undefined;
      const taskId = isObject(entry) ? get(entry, "taskId") : undefined;
      const blocks = isObject(entry) ? countOf(get(entry, "blocks")) : null;
      const pane = nonEmptyString(callId) ? this._panes.get(callId) : undefined;
      const task = pane && nonEmptyString(taskId) ? pane.tasks.get(taskId) : undefined;
      if (blocks === null || task === undefined) {
        this.dropped.ignoredAck += 1;
        continue;
      }
      task.missing = Math.min(task.missing + blocks, MAX_COUNT);
      if (task.gapAfter === null) {
        const key = streamKey(callId, taskId);
        task.gapAfter = cursors.has(key) ? cursors.get(key) : task.items.length > 0 ? task.items[0].seq : -1;
      }
      results.push(this._result("missing", { callId, taskId }));
    }
  }

  /**
   * Mark panes without blocks whose timeout has passed at `now` (default: the clock);
   * returns the callIds whose status became "no_details".
   */
  tick(now = this.clock()) {
    const changed = [];
    for (const pane of this._panes.values()) {
      if (pane.tasks.size > 0 || pane.timedOut || now - pane.openedAt < this.timeoutMs) continue;
      const before = pane.status;
      pane.timedOut = true;
      if (pane.status !== before) changed.push(pane.callId);
    }
    for (const callId of changed) this._result("timeout", { callId });
    return changed;
  }
}

/**
 * Feed a Socket.IO client (namespace /chat) into `store`: `tool_event_stream` blocks and
 * `chat_event` snapshots, plus a timer that calls store.tick() every `tickMs`. With
 * `conversationId`, emits `join_conversation` on every (re)connect — after a reconnect the
 * server has forgotten the room — as `{conversationId, have}`: the cursors of what the store
 * already holds (store.beginReplay(); an empty list while it holds nothing), so a relay that
 * catches up sends only the rest, and says in its answer what it sent. The panes are in mode "replay" from the join until its
 * acknowledgement, which goes to store.endReplay(ack) and then to `onJoin(ack)`. A join
 * that is refused, or not answered within `joinTimeoutMs` (onJoin(null) then; a later
 * answer is ignored), or superseded by the next reconnect's, or detached, leaves no pane in
 * "replay". Returns a function that detaches everything.
 */
export function attachSocket(
  socket,
  store,
  { conversationId = null, onJoin = null, tickMs = 1000, joinTimeoutMs = DEFAULT_JOIN_TIMEOUT_MS } = {},
) {
  const onBlock = (block) => store.applyBlock(block);
  const onSnapshot = (event) => store.applySnapshot(event);
  let pending = null; // the join awaiting its acknowledgement: {timer}
  const settle = (join, ack, report) => {
    if (pending !== join) return; // answered, timed out, superseded or detached already
    pending = null;
    if (join.timer !== null) clearTimeout(join.timer);
    store.endReplay(ack);
    if (report && onJoin) onJoin(ack);
  };
  const join = () => {
    if (conversationId === null) return;
    if (pending !== null && pending.timer !== null) clearTimeout(pending.timer); // superseded
    const request = { conversationId, have: store.beginReplay() };
    const current = { timer: null };
    pending = current;
    if (joinTimeoutMs > 0) current.timer = setTimeout(() => settle(current, null, true), joinTimeoutMs);
    socket.emit("join_conversation", request, (ack) => settle(current, ack, true));
  };
  socket.on("tool_event_stream", onBlock);
  socket.on("chat_event", onSnapshot);
  socket.on("connect", join);
  if (socket.connected) join();
  const timer = tickMs > 0 ? setInterval(() => store.tick(), tickMs) : null;
  return () => {
    socket.off("tool_event_stream", onBlock);
    socket.off("chat_event", onSnapshot);
    socket.off("connect", join);
    if (timer !== null) clearInterval(timer);
    if (pending !== null) settle(pending, null, false);
  };
}

/**
 * The `stop` option of mountPane / mountRoom for a Socket.IO client (namespace /chat) that
 * follows `conversationId` (attachSocket's): `stop(callId)` emits one `stop_call`
 * {v: 1, room: conversationId, callId} and resolves — never rejects — with
 * {answer, reason}: `answer` one of STOP_ANSWERS as the relay acknowledged it, "offline" when
 * the socket was not connected (nothing is emitted: the client would buffer the request and
 * send it after a reconnect), or "failed" when no acknowledgement came within `timeoutMs`
 * or it was not {answer: one of STOP_ANSWERS}; `reason` the acknowledgement's short text
 * (a string) or null.
 */
export function stopSender(socket, conversationId, { timeoutMs = DEFAULT_STOP_TIMEOUT_MS } = {}) {
  if (!nonEmptyString(conversationId)) {
    throw new TypeError(`conversationId must be a non-empty string, got ${typeof conversationId}`);
  }
  if (!(typeof timeoutMs === "number" && timeoutMs > 0 && timeoutMs <= 2147483647)) {
    throw new RangeError(`timeoutMs must be a number > 0 of milliseconds, got ${String(timeoutMs)}`);
  }
  return (callId) =>
    new Promise((resolve) => {
      if (!socket.connected) {
        resolve({ answer: "offline", reason: null });
        return;
      }
      const request = { v: 1, room: conversationId, callId };
      socket.timeout(timeoutMs).emit("stop_call", request, (error, ack) => {
        resolve(error ? { answer: "failed", reason: null } : readStopAnswer(ack));
      });
    });
}

/** An acknowledgement of `stop_call` as received: {answer, reason} (see stopSender). */
export function readStopAnswer(ack) {
  const answer = isObject(ack) ? get(ack, "answer") : undefined;
  if (!STOP_ANSWERS.includes(answer)) return { answer: "failed", reason: null };
  const reason = get(ack, "reason");
  return { answer, reason: typeof reason === "string" && reason !== "" ? reason : null };
}

// ---------------------------------------------------------------------------------------
// DOM views. Constant markup only; data goes in through textContent and attribute values.

const STYLE_ID = "kx-renderer-style";
// The font stacks, in one place (the custom properties --kx-font and --kx-mono, which a page
// may use for its own text too): Latin faces first, then common CJK faces (macOS, Windows,
// Linux), the generic family, and last "kernel_ext CJK" — the package's CJK subset
// (kernel_ext/web/font.py: fonts/), for a page that declares it with @font-face, as
// example.html does. The default labels are Chinese; a machine with no CJK face shows them
// as boxes unless the page declares that face.
const STYLE = `
:root { --kx-font: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, "PingFang SC", "Hiragino Sans GB", "Microsoft YaHei", "Noto Sans CJK SC", "Source Han Sans SC", "WenQuanYi Micro Hei", sans-serif, "kernel_ext CJK"; --kx-mono: ui-monospace, monospace, "kernel_ext CJK"; }
.kx-room, .kx-room-panes, .kx-room-orphans { display: flex; flex-direction: column; gap: 12px; }
.kx-pane { border: 1px solid #d0d4da; border-radius: 8px; padding: 10px 12px; font: 14px/1.45 var(--kx-font); color: #1f2328; background: #fff; }
.kx-head { display: flex; gap: 8px; align-items: baseline; flex-wrap: wrap; }
.kx-tool { font-weight: 600; overflow-wrap: anywhere; }
.kx-call-id { color: #6e7781; font: 12px var(--kx-mono); overflow-wrap: anywhere; }
.kx-status { margin-left: auto; font-size: 12px; color: #57606a; }
.kx-mode { font-size: 12px; color: #9a6700; }
.kx-pane[data-status="streaming"] .kx-status { color: #0969da; }
.kx-final { margin: 8px 0; padding: 8px 10px; border-left: 3px solid #1a7f37; background: #f0fff4; }
.kx-final[data-from="aborted"] { border-left-color: #cf222e; background: #fff5f5; }
.kx-final[data-from="stopped"] { border-left-color: #8c959f; background: #f6f8fa; }
.kx-final-label { font-size: 12px; color: #57606a; }
.kx-final-text, .kx-text, .kx-thinking-body p, .kx-other-text { white-space: pre-wrap; overflow-wrap: anywhere; margin: 0; }
.kx-stream { max-height: 24em; overflow: auto; margin-top: 6px; }
.kx-pane[data-status="ended"] .kx-stream { color: #57606a; }
.kx-task + .kx-task { margin-top: 8px; border-top: 1px dashed #d0d4da; padding-top: 6px; }
.kx-task-head { font-size: 12px; color: #57606a; overflow-wrap: anywhere; }
.kx-items > * { margin: 4px 0; }
.kx-thinking summary { cursor: pointer; color: #6e7781; font-style: italic; }
.kx-thinking-body { padding-left: 1em; color: #57606a; }
.kx-tool-call { font: 13px var(--kx-mono); overflow-wrap: anywhere; }
.kx-marker { color: #8250df; }
.kx-tool-start { color: #6e7781; }
.kx-output { background: #0d1117; color: #e6edf3; font: 12px/1.4 var(--kx-mono); padding: 6px 8px; border-radius: 4px; max-height: 14em; overflow: auto; white-space: pre-wrap; overflow-wrap: anywhere; }
.kx-progress { display: flex; gap: 8px; align-items: center; font-size: 13px; color: #57606a; }
.kx-progress-bar { flex: 0 0 12em; height: 0.8em; }
.kx-progress-count { font: 12px var(--kx-mono); white-space: nowrap; }
.kx-progress-text { overflow-wrap: anywhere; }
.kx-other { color: #6e7781; font-size: 13px; }
.kx-other-kind { font: 12px var(--kx-mono); overflow-wrap: anywhere; }
.kx-missing { color: #9a6700; font-size: 12px; font-style: italic; border-left: 2px dotted #d4a72c; padding-left: 8px; }
.kx-empty, .kx-end { color: #6e7781; font-size: 12px; text-align: center; }
.kx-stop-box { display: inline-flex; gap: 6px; align-items: baseline; flex-wrap: wrap; }
.kx-stop { font: 12px var(--kx-font); padding: 1px 8px; border: 1px solid #cf222e; border-radius: 4px; color: #cf222e; background: #fff; cursor: pointer; }
.kx-stop:disabled { border-color: #d0d4da; color: #6e7781; cursor: default; }
.kx-stop-note { font-size: 12px; color: #9a6700; overflow-wrap: anywhere; }
.kx-orphan { border: 1px dashed #d0d4da; border-radius: 8px; padding: 8px 12px; font: 14px/1.45 var(--kx-font); }
`;

/** Put the renderer's stylesheet (constant text) into `doc` once. */
export function ensureStyles(doc = globalThis.document) {
  if (doc.getElementById(STYLE_ID)) return;
  const style = doc.createElement("style");
  style.id = STYLE_ID;
  style.textContent = STYLE;
  (doc.head || doc.documentElement).appendChild(style);
}

function el(doc, tag, className, text) {
  const node = doc.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
}

function atBottom(node) {
  return node.scrollHeight - node.scrollTop - node.clientHeight <= 4;
}

// Runs of consecutive thinking / tool_output_append / progress items render as one segment
// each (a run of progress items as one bar showing the latest); a run does not span the
// place of blocks the task lacks for good (after seq `gapAfter`).
const RUN_KINDS = new Set(["thinking", "tool_output_append", "progress"]);

function segmentsOf(items, gapAfter = null) {
  const segments = [];
  for (const item of items) {
    const last = segments[segments.length - 1];
    const runs = RUN_KINDS.has(item.kind);
    const acrossGap =
      gapAfter !== null && last && last.items[last.items.length - 1].seq <= gapAfter && item.seq > gapAfter;
    if (runs && last && last.kind === item.kind && !acrossGap) {
      last.items.push(item);
      continue;
    }
    segments.push({ kind: item.kind, key: `${item.kind}:${item.seq}`, items: [item] });
  }
  for (const segment of segments) segment.sig = segment.items.map((item) => item.seq).join(",");
  return segments;
}

// Views render at most once per animation frame while their pane catches up.
// (No requestAnimationFrame outside a page: a timer of one frame's length instead.)
const hasFrames = () => typeof globalThis.requestAnimationFrame === "function";
const requestFrame = (fn) => (hasFrames() ? globalThis.requestAnimationFrame(fn) : setTimeout(fn, 16));
const cancelFrame = (handle) => (hasFrames() ? globalThis.cancelAnimationFrame(handle) : clearTimeout(handle));

// What a stop's answer other than "stopping" shows in the pane: its words, and the relay's
// reason (cut to MAX_REASON_CHARS) in parentheses.
const STOP_NOTES = {
  already_ended: "stopAlreadyEnded",
  unknown: "stopUnknown",
  refused: "stopRefused",
  unreachable: "stopUnreachable",
  offline: "stopOffline",
};

function stopNoteText(labels, answer, reason) {
  const words = labels[has(STOP_NOTES, answer) ? STOP_NOTES[answer] : "stopFailed"];
  if (reason === null) return words;
  const cut = reason.length > MAX_REASON_CHARS ? `${reason.slice(0, MAX_REASON_CHARS)}…` : reason;
  return `${words} (${cut})`;
}

function statusLabel(labels, status) {
  return { calling: labels.calling, streaming: labels.streaming, ended: labels.ended, no_details: labels.noDetails }[status];
}

// Reorder `parent`'s children to `nodes`, moving only what is out of place (moving a node
// would reset its scroll position).
function placeChildren(parent, nodes) {
  const wanted = new Set(nodes);
  for (const child of Array.from(parent.children)) if (!wanted.has(child)) child.remove();
  nodes.forEach((node, index) => {
    const current = parent.children[index];
    if (current !== node) parent.insertBefore(node, current || null);
  });
}

// A progress bar shows the latest report of its run: determinate when the total is a
// positive number (value clamped to [0, total]), indeterminate otherwise.
function fillProgress(node, item) {
  const [bar, count, text] = node.children;
  const { progress, total } = item;
  if (progress !== null && total !== null && total > 0) {
    bar.max = total;
    bar.value = Math.min(Math.max(progress, 0), total);
    count.textContent = `${progress}/${total} · ${Math.floor((100 * bar.value) / total)}%`;
  } else {
    bar.removeAttribute("value");
    count.textContent = progress === null ? "" : String(progress);
  }
  text.textContent = item.text === null ? "" : item.text;
  node.dataset.progress = progress === null ? "" : String(progress);
  node.dataset.total = total === null ? "" : String(total);
}

class PaneView {
  constructor(container, store, callId, options) {
    this.store = store;
    this.callId = callId;
    this.labels = labelsFor(options.locale, options.labels);
    const doc = (this.doc = options.document || container.ownerDocument || globalThis.document);
    if (options.injectStyles !== false) ensureStyles(doc);
    const root = (this.element = el(doc, "section", "kx-pane"));
    root.dataset.callId = callId;
    const head = el(doc, "header", "kx-head");
    this.toolNode = el(doc, "span", "kx-tool");
    this.callIdNode = el(doc, "span", "kx-call-id", callId);
    this.traceUrl = options.traceUrl;
    this.traceHref = null;
    this.modeNode = el(doc, "span", "kx-mode", this.labels.replay);
    this.statusNode = el(doc, "span", "kx-status");
    head.append(this.toolNode, this.callIdNode, this.modeNode, this.statusNode);
    this.head = head;
    // The stop control (option `stop`): a button and a note of what came of a click, in a
    // box that is in the head only while the call runs.
    this.stop = typeof options.stop === "function" ? options.stop : null;
    this.stopState = "idle"; // "idle" | "sending" | "stopping" | "over" (it had ended)
    this.stopNote = null; // {answer, text} of the last click, or null
    if (this.stop !== null) {
      this.stopBox = el(doc, "span", "kx-stop-box");
      this.stopButton = el(doc, "button", "kx-stop");
      this.stopButton.type = "button";
      this.stopButton.addEventListener("click", () => this.requestStop());
      this.stopNoteNode = el(doc, "span", "kx-stop-note");
      this.stopNoteNode.setAttribute("role", "status");
      this.stopBox.append(this.stopButton, this.stopNoteNode);
    }
    this.finalNode = el(doc, "div", "kx-final");
    this.finalLabel = el(doc, "div", "kx-final-label");
    this.finalText = el(doc, "div", "kx-final-text");
    this.finalNode.append(this.finalLabel, this.finalText);
    this.finalNode.hidden = true;
    this.streamNode = el(doc, "div", "kx-stream");
    this.tasksNode = el(doc, "div", "kx-tasks");
    this.emptyNode = el(doc, "div", "kx-empty", this.labels.noDetails);
    this.endNode = el(doc, "div", "kx-end", `— ${this.labels.ended} —`);
    this.streamNode.append(this.tasksNode, this.emptyNode, this.endNode);
    root.append(head, this.finalNode, this.streamNode);
    container.appendChild(root);
    this.taskViews = new Map();
    this.frame = null;
    this.destroyed = false;
    this.unsubscribe = store.subscribe((applied) => {
      if (applied.callId === callId) this.changed(applied);
    });
    this.update();
  }

  // Live, every change renders at once. While the pane catches up (a burst of up to
  // thousands of blocks), changes render once per animation frame, and the switch back to
  // "live" renders what is left at once: a long catch-up never re-renders per block.
  changed(applied) {
    const pane = this.store.pane(this.callId);
    if (pane && pane.mode === "replay" && applied.outcome !== "mode") {
      if (this.frame === null) this.frame = requestFrame(() => this.update());
    } else {
      this.update();
    }
  }

  update() {
    if (this.frame !== null) cancelFrame(this.frame);
    this.frame = null;
    const pane = this.store.pane(this.callId);
    const labels = this.labels;
    const status = pane ? pane.status : "calling";
    const root = this.element;
    root.dataset.status = status;
    root.dataset.mode = pane ? pane.mode : "live";
    this.modeNode.hidden = root.dataset.mode !== "replay";
    this.toolNode.textContent = (pane && pane.tool) || "";
    this.renderTraceLink(pane ? traceUrl(this.traceUrl, pane.traceId, this.callId) : null);
    this.statusNode.textContent = statusLabel(labels, status);
    if (this.stop !== null) this.renderStop(pane);
    const final = pane ? pane.final : null;
    this.finalNode.hidden = final === null;
    if (final !== null) {
      this.finalNode.dataset.from = final.from;
      this.finalLabel.textContent = finalLabel(labels, final.from);
      this.finalText.textContent = final.text;
    }
    const follow = atBottom(this.streamNode);
    const tasks = pane ? Array.from(pane.tasks.values()) : [];
    const nodes = tasks.map((task) => this.renderTask(task, tasks.length > 1));
    placeChildren(this.tasksNode, nodes);
    this.emptyNode.hidden = status !== "no_details";
    this.endNode.hidden = status !== "ended";
    this.streamNode.classList.toggle("kx-ended", status === "ended");
    if (follow) this.streamNode.scrollTop = this.streamNode.scrollHeight;
  }

  // Whether the pane's call may still be running, as far as the page knows: it has begun
  // (the store holds its pane), has not ended (no terminal of every stream, no tool return)
  // and has a callId a relay could stop (a span id).
  running(pane) {
    return pane !== null && pane.status !== "ended" && !pane.returned && SPAN_ID.test(this.callId);
  }

  // The stop control: in the head while the call runs and a click may still help; "Stop",
  // else disabled "Stopping…" from the click until an answer other than "stopping", or
  // until the terminal when the relay answered "stopping"; the note says what else came of
  // the last click. Gone at the end.
  renderStop(pane) {
    const running = this.running(pane);
    const showButton = running && this.stopState !== "over";
    const note = running ? this.stopNote : null;
    if (!showButton) this.stopButton.remove();
    else if (!this.stopButton.isConnected) this.stopBox.prepend(this.stopButton);
    if (!showButton && note === null) this.stopBox.remove();
    else if (!this.stopBox.isConnected) this.head.append(this.stopBox);
    if (running) this.element.dataset.stop = this.stopState;
    else delete this.element.dataset.stop;
    if (showButton) {
      const idle = this.stopState === "idle";
      this.stopButton.disabled = !idle;
      this.stopButton.textContent = idle ? this.labels.stop : this.labels.stopping;
      this.stopButton.setAttribute("aria-label", idle ? this.labels.stopCall : this.labels.stopping);
    }
    this.stopNoteNode.hidden = note === null;
    this.stopNoteNode.textContent = note === null ? "" : note.text;
    if (note === null) delete this.stopNoteNode.dataset.answer;
    else this.stopNoteNode.dataset.answer = note.answer;
  }

  // One click: one request, unless one is under way or the call is over.
  async requestStop() {
    if (this.stop === null || this.stopState !== "idle" || !this.running(this.store.pane(this.callId))) return;
    this.stopState = "sending";
    this.stopNote = null;
    this.update();
    let result;
    try {
      result = await this.stop(this.callId);
    } catch (error) {
      console.error("kernel_ext renderer: the stop option failed", error);
      result = null;
    }
    const answer = isObject(result) && typeof get(result, "answer") === "string" ? result.answer : "failed";
    const reason = isObject(result) && nonEmptyString(get(result, "reason")) ? result.reason : null;
    if (answer === "stopping") {
      this.stopState = "stopping";
    } else {
      this.stopState = answer === "already_ended" ? "over" : "idle";
      this.stopNote = { answer, text: stopNoteText(this.labels, answer, reason) };
    }
    if (!this.destroyed) this.update();
  }

  // The callId, as a link to its span when the page gave a `traceUrl` and the pane has a
  // trace id (built with DOM calls: the address only ever goes into an href attribute).
  renderTraceLink(href) {
    if (href === this.traceHref) return;
    this.traceHref = href;
    const node = this.callIdNode;
    if (href === null) {
      node.textContent = this.callId;
      return;
    }
    const link = el(this.doc, "a", "kx-trace", this.callId);
    link.setAttribute("href", href);
    link.setAttribute("target", "_blank");
    link.setAttribute("rel", "noopener noreferrer");
    node.replaceChildren(link);
  }

  renderTask(task, showHead) {
    const doc = this.doc;
    let view = this.taskViews.get(task.taskId);
    if (!view) {
      const node = el(doc, "div", "kx-task");
      node.dataset.taskId = task.taskId;
      const head = el(doc, "div", "kx-task-head");
      const items = el(doc, "div", "kx-items");
      node.append(head, items);
      view = { node, head, items, segments: new Map(), missing: null };
      this.taskViews.set(task.taskId, view);
    }
    view.head.hidden = !showHead;
    const outcome =
      task.outcome === "aborted" || task.outcome === "stopped"
        ? finalLabel(this.labels, task.outcome)
        : task.ended
          ? this.labels.ended
          : "";
    view.head.textContent = `${this.labels.task} ${task.taskId}${outcome ? ` · ${outcome}` : ""}`;
    view.node.dataset.ended = String(task.ended);
    const gapAfter = task.missing > 0 ? task.gapAfter : null;
    const segments = segmentsOf(task.items, gapAfter);
    const nodes = [];
    const keep = new Map();
    for (const segment of segments) {
      let cached = view.segments.get(segment.key);
      if (!cached || cached.kind !== segment.kind) {
        cached = { kind: segment.kind, node: this.createSegment(segment), sig: null, count: 0 };
      }
      if (cached.sig !== segment.sig) {
        // Items appended to a run (the usual case) are appended to its node.
        const from = cached.sig !== null && segment.sig.startsWith(`${cached.sig},`) ? cached.count : 0;
        this.fillSegment(cached.node, segment, from);
        cached.sig = segment.sig;
        cached.count = segment.items.length;
      }
      keep.set(segment.key, cached);
      nodes.push(cached.node);
    }
    view.segments = keep;
    if (gapAfter !== null) {
      if (view.missing === null) view.missing = el(doc, "div", "kx-missing");
      view.missing.textContent = missingText(this.labels, task.missing);
      view.missing.dataset.missing = String(task.missing);
      const at = segments.findIndex((segment) => segment.items[0].seq > gapAfter);
      nodes.splice(at === -1 ? nodes.length : at, 0, view.missing);
    }
    placeChildren(view.items, nodes);
    return view.node;
  }

  createSegment(segment) {
    const doc = this.doc;
    const labels = this.labels;
    const first = segment.items[0];
    switch (segment.kind) {
      case "thinking": {
        const node = el(doc, "details", "kx-thinking");
        node.append(el(doc, "summary", "kx-thinking-summary", labels.thinking), el(doc, "div", "kx-thinking-body"));
        return node;
      }
      case "tool_output_append":
        return el(doc, "pre", "kx-output");
      case "tool_call": {
        const node = el(doc, "div", "kx-tool-call");
        node.append(
          el(doc, "span", "kx-marker", "▶"),
          doc.createTextNode(" "),
          el(doc, "span", "kx-tool-name", first.tool === null ? "?" : first.tool),
          doc.createTextNode(" "),
          el(doc, "span", "kx-tool-start", labels.toolStart),
        );
        return node;
      }
      case "text":
        return el(doc, "p", "kx-text", first.text);
      case "progress": {
        const node = el(doc, "div", "kx-progress");
        node.append(el(doc, "progress", "kx-progress-bar"), el(doc, "span", "kx-progress-count"), el(doc, "span", "kx-progress-text"));
        return node;
      }
      default: {
        const node = el(doc, "div", "kx-other");
        node.append(el(doc, "span", "kx-other-kind", `[${labels.unknownKind}: ${first.envelopeKind}]`));
        if (first.text !== null) node.append(doc.createTextNode(" "), el(doc, "span", "kx-other-text", first.text));
        return node;
      }
    }
  }

  // Fill `node` with `segment`, whose items before index `from` it already shows.
  fillSegment(node, segment, from = 0) {
    const added = segment.items.slice(from);
    if (segment.kind === "thinking") {
      const body = node.lastChild;
      if (from === 0) placeChildren(body, []);
      for (const item of added) body.appendChild(el(this.doc, "p", null, item.text));
    } else if (segment.kind === "progress") {
      fillProgress(node, segment.items[segment.items.length - 1]);
    } else if (segment.kind === "tool_output_append") {
      const follow = node.isConnected ? atBottom(node) : true;
      const text = added.map((item) => item.text).join("");
      if (from === 0) node.textContent = text;
      else node.appendChild(this.doc.createTextNode(text));
      if (follow) this.followLater(node);
    }
    node.dataset.seq = segment.sig;
  }

  // A new node has no layout until it is in the document: scroll once the update is done.
  followLater(node) {
    if (node.isConnected) node.scrollTop = node.scrollHeight;
    else queueMicrotask(() => (node.scrollTop = node.scrollHeight));
  }

  destroy() {
    this.destroyed = true;
    this.unsubscribe();
    if (this.frame !== null) cancelFrame(this.frame);
    this.frame = null;
    this.element.remove();
  }
}

/**
 * Render the pane of `callId` into `container` (appended) and keep it up to date.
 * Options: locale ("zh" default, "en"), labels (overrides), document, injectStyles (default
 * true), traceUrl (a template such as "https://jaeger.example/trace/{traceId}?uiFind={spanId}":
 * the callId links to traceUrl(template, pane.traceId, callId) when that is not null),
 * stop (off by default: a function callId => Promise<{answer, reason}>, such as
 * stopSender(socket, conversationId) makes; with it, a running pane whose callId is a span
 * id has a stop button: one click calls it once, the button then says "Stopping…" and is
 * disabled until the answer — until the terminal when the answer is "stopping" — and any
 * other answer is shown beside it; the control is gone once the call has ended).
 * Returns {element, update(), destroy()}.
 */
export function mountPane(container, store, callId, options = {}) {
  const view = new PaneView(container, store, callId, options);
  return { element: view.element, update: () => view.update(), destroy: () => view.destroy() };
}

/**
 * Render every pane of `store` into `container`, in order of first appearance, plus the
 * final answers of calls without a callId; new panes appear as they open.
 * Options as for mountPane. Returns {element, destroy()}.
 */
export function mountRoom(container, store, options = {}) {
  const doc = options.document || container.ownerDocument || globalThis.document;
  if (options.injectStyles !== false) ensureStyles(doc);
  const labels = labelsFor(options.locale, options.labels);
  const root = el(doc, "div", "kx-room");
  const panesNode = el(doc, "div", "kx-room-panes");
  const orphansNode = el(doc, "div", "kx-room-orphans");
  root.append(panesNode, orphansNode);
  container.appendChild(root);
  const views = new Map();
  const paneOptions = { ...options, document: doc, injectStyles: false };
  const sync = () => {
    for (const pane of store.panes) {
      if (!views.has(pane.callId)) views.set(pane.callId, mountPane(panesNode, store, pane.callId, paneOptions));
    }
    const orphans = store.orphans;
    while (orphansNode.children.length < orphans.length) {
      const orphan = orphans[orphansNode.children.length];
      const node = el(doc, "div", "kx-orphan");
      node.dataset.taskId = orphan.taskId;
      node.dataset.from = orphan.outcome;
      const label = `${labels.unattributed} · ${finalLabel(labels, orphan.outcome)}`;
      node.append(el(doc, "div", "kx-final-label", label), el(doc, "div", "kx-final-text", orphan.text));
      orphansNode.appendChild(node);
    }
  };
  const unsubscribe = store.subscribe((applied) => {
    if (applied.newPane || applied.outcome === "orphan") sync();
  });
  sync();
  return {
    element: root,
    destroy() {
      unsubscribe();
      for (const view of views.values()) view.destroy();
      root.remove();
    },
  };
}
