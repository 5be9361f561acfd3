// Every conformance vector in tests/vectors through kernel_ext/web/renderer.js (node --test).
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import {
  PaneStore,
  LABELS,
  labelsFor,
  attachSocket,
  missingText,
  DEFAULT_TIMEOUT_MS,
  DEFAULT_JOIN_TIMEOUT_MS,
  MAX_JOIN_STREAMS,
  traceUrl,
} from "../../kernel_ext/web/renderer.js";

const here = dirname(fileURLToPath(import.meta.url));
const vectorsDir = join(here, "..", "vectors");
const rendererPath = join(here, "..", "..", "kernel_ext", "web", "renderer.js");

function expand(value) {
  if (Array.isArray(value)) return value.map(expand);
  if (value !== null && typeof value === "object") {
    const keys = Object.keys(value).sort().join(",");
    if (keys === "$repeat,times") return String(value.$repeat).repeat(value.times);
    if (keys === "$concat") return value.$concat.map(expand).join("");
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, expand(v)]));
  }
  return value;
}

function runVector(vector) {
  let now = 0;
  const store = new PaneStore({ timeoutMs: vector.options.timeoutMs, clock: () => now });
  const checkpoints = [];
  vector.steps.forEach((step, index) => {
    const [key] = Object.keys(step);
    if (key === "block") store.applyBlock(step.block);
    else if (key === "snapshot") store.applySnapshot(step.snapshot);
    else if (key === "tick") {
      now = Math.max(now, step.tick);
      store.tick(now);
    } else if (key === "join") checkpoints.push([index, { have: store.beginReplay() }]);
    else if (key === "ack") store.endReplay(step.ack);
    else if (key === "expect") checkpoints.push([index, store.state()]);
    else throw new Error(`unknown step kind ${key} at step ${index}`);
  });
  return { store, checkpoints };
}

const files = readdirSync(vectorsDir).filter((name) => name.endsWith(".json")).sort();

test("the vector directory is not empty", () => {
  assert.ok(files.length >= 16, `only ${files.length} vectors found in ${vectorsDir}`);
});

for (const file of files) {
  test(`renderer.js reproduces vector ${file}`, () => {
    const vector = expand(JSON.parse(readFileSync(join(vectorsDir, file), "utf8")));
    const { store, checkpoints } = runVector(vector);
    for (const [index, seen] of checkpoints) {
      const step = vector.steps[index];
      assert.deepStrictEqual(seen, "expect" in step ? step.expect : step.join, `checkpoint at step ${index}`);
    }
    assert.deepStrictEqual(store.state(), vector.expect);
    // The state is plain JSON data.
    assert.deepStrictEqual(JSON.parse(JSON.stringify(store.state())), store.state());
  });
}

test("the renderer source never parses data as HTML", () => {
  const source = readFileSync(rendererPath, "utf8");
  for (const sink of ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser", "createContextualFragment", "srcdoc", "eval("]) {
    assert.ok(!source.includes(sink), `renderer.js mentions ${sink}`);
  }
});

test("labels default to the spec's Chinese, English on request, overrides on top", () => {
  assert.equal(labelsFor().thinking, "思考中…");
  assert.equal(labelsFor().ended, "已结束");
  assert.equal(labelsFor("en").ended, "Ended");
  assert.equal(labelsFor("xx").noDetails, LABELS.zh.noDetails);
  assert.equal(labelsFor("en", { ended: "Done" }).ended, "Done");
  assert.deepStrictEqual(Object.keys(LABELS.zh).sort(), Object.keys(LABELS.en).sort());
  assert.throws(() => { LABELS.zh.ended = "x"; }, TypeError);
});

test("the default timeout applies and the default clock is Date.now", () => {
  const store = new PaneStore();
  assert.equal(store.timeoutMs, DEFAULT_TIMEOUT_MS);
  store.applySnapshot({ eventId: "00f067aa0ba902b7", eventScene: "tool" });
  assert.deepStrictEqual(store.tick(Date.now() + DEFAULT_TIMEOUT_MS + 1), ["00f067aa0ba902b7"]);
  assert.equal(store.pane("00f067aa0ba902b7").status, "no_details");
  assert.throws(() => new PaneStore({ timeoutMs: -1 }), RangeError);
});

test("listeners see every outcome and a failing listener harms no one", () => {
  const store = new PaneStore();
  const seen = [];
  const originalError = console.error;
  console.error = () => {};
  try {
    store.subscribe(() => { throw new Error("broken view"); });
    const unsubscribe = store.subscribe((applied) => seen.push(applied.outcome));
    const block = { v: 1, callId: "00f067aa0ba902b7", taskId: "t", state: "running", ts: 0,
                    envelope: { kind: "text", seq: 1, payload: { text: "x" } } };
    store.applyBlock(block);
    store.applyBlock(block);
    store.applyBlock("junk");
    unsubscribe();
    store.applyBlock({ ...block, state: "done" });
  } finally {
    console.error = originalError;
  }
  assert.deepStrictEqual(seen, ["item", "duplicate", "invalid"]);
  assert.equal(store.pane("00f067aa0ba902b7").status, "ended");
});

class FakeSocket {
  constructor() { this.handlers = new Map(); this.emitted = []; this.connected = false; }
  on(name, fn) { (this.handlers.get(name) || this.handlers.set(name, new Set()).get(name)).add(fn); }
  off(name, fn) { this.handlers.get(name)?.delete(fn); }
  emit(name, data, ack) { this.emitted.push([name, data]); if (ack) ack({ ok: true }); }
  fire(name, data) { for (const fn of this.handlers.get(name) || []) fn(data); }
}

test("attachSocket feeds blocks and snapshots, joins on every connect, detaches cleanly", () => {
  const socket = new FakeSocket();
  const store = new PaneStore();
  const acks = [];
  const detach = attachSocket(socket, store, { conversationId: "conv-1", onJoin: (ack) => acks.push(ack), tickMs: 0 });
  socket.connected = true;
  socket.fire("connect");
  socket.fire("chat_event", { eventId: "00f067aa0ba902b7", eventScene: "tool", content: { toolCall: { toolId: "ask_colleague" } } });
  socket.fire("tool_event_stream", { v: 1, callId: "00f067aa0ba902b7", taskId: "t", state: "running", ts: 0,
                                     envelope: { kind: "thinking", seq: 1.0, payload: { text: "hm" } } });
  socket.fire("connect");
  assert.deepStrictEqual(socket.emitted, [
    ["join_conversation", { conversationId: "conv-1", have: [] }], // holds nothing yet
    ["join_conversation", { conversationId: "conv-1", have: [{ callId: "00f067aa0ba902b7", taskId: "t", seq: 1 }] }],
  ]);
  assert.deepStrictEqual(acks, [{ ok: true }, { ok: true }]);
  assert.equal(store.pane("00f067aa0ba902b7").tool, "ask_colleague");
  assert.equal(store.pane("00f067aa0ba902b7").status, "streaming");
  detach();
  socket.fire("tool_event_stream", { v: 1, callId: "a1b2c3d4e5f60718", taskId: "t", state: "running", ts: 0,
                                     envelope: { kind: "text", seq: 1 } });
  socket.fire("connect");
  assert.equal(store.panes.length, 1);
  assert.equal(socket.emitted.length, 2);
});

// -- catch-up (docs/web.md "Catching up") ------------------------------------------------

const A = "00f067aa0ba902b7";
const B = "a1b2c3d4e5f60718";

function running(callId, taskId, seq, text = `${taskId} #${seq}`) {
  return { v: 1, callId, taskId, state: "running", ts: 0, envelope: { v: 1, kind: "text", streamKey: taskId, seq, status: "running", payload: { text } } };
}

function done(callId, taskId, seq, text = "answer") {
  return { v: 1, callId, taskId, state: "done", ts: 0, envelope: { v: 1, kind: "text", streamKey: taskId, seq, status: "done", payload: { text } } };
}

test("a join's catch-up reports mode and missing to listeners, missing before the switch to live", () => {
  const store = new PaneStore();
  store.applyBlock(running(A, "t", 1));
  const seen = [];
  store.subscribe((applied) => seen.push([applied.outcome, applied.callId, applied.taskId]));
  assert.deepStrictEqual(store.beginReplay(), [{ callId: A, taskId: "t", seq: 1 }]);
  assert.equal(store.replaying, true);
  store.applyBlock(running(B, "u", 1));
  const results = store.endReplay({ ok: true, replay: { blocks: 1, streams: 1, missing: [{ callId: A, taskId: "t", blocks: 2 }] } });
  assert.equal(store.replaying, false);
  assert.deepStrictEqual(seen, [
    ["mode", A, null],
    ["item", B, "u"],
    ["missing", A, "t"],
    ["mode", A, null],
    ["mode", B, null],
  ]);
  assert.deepStrictEqual(results.map((r) => r.outcome), ["missing", "mode", "mode"]);
  assert.equal(store.pane(A).tasks.get("t").missing, 2);
  assert.equal(store.pane(A).tasks.get("t").gapAfter, 1); // after what the join said it held
});

test("a fresh store's gap is after the stream's first block, before everything without items", () => {
  const store = new PaneStore();
  store.beginReplay();
  store.applyBlock(running(A, "t", 1));
  store.applyBlock(running(A, "t", 40));
  store.applyBlock(done(A, "v", 9));
  store.endReplay({ ok: true, replay: { missing: [{ callId: A, taskId: "t", blocks: 38 }, { callId: A, taskId: "v", blocks: 8 }] } });
  assert.equal(store.pane(A).tasks.get("t").gapAfter, 1);
  assert.equal(store.pane(A).tasks.get("v").gapAfter, -1);
  // A later ack adds to the count and keeps the first gap's place.
  store.beginReplay();
  store.endReplay({ ok: true, replay: { missing: [{ callId: A, taskId: "t", blocks: 2 }] } });
  assert.equal(store.pane(A).tasks.get("t").missing, 40);
  assert.equal(store.pane(A).tasks.get("t").gapAfter, 1);
});

test("have names at most MAX_JOIN_STREAMS streams, the open ones first", () => {
  assert.equal(MAX_JOIN_STREAMS, 1000);
  const store = new PaneStore();
  store.applyBlock(done("0000000000000000", "ended", 3));
  for (let index = 0; index < MAX_JOIN_STREAMS; index += 1) store.applyBlock(running(A, `t${index}`, index));
  store.applyBlock(done(null, "orphan", 2));
  const have = store.have();
  assert.equal(have.length, MAX_JOIN_STREAMS);
  assert.deepStrictEqual(have[0], { callId: A, taskId: "t0", seq: 0 });
  assert.deepStrictEqual(have[MAX_JOIN_STREAMS - 1], { callId: A, taskId: `t${MAX_JOIN_STREAMS - 1}`, seq: MAX_JOIN_STREAMS - 1 });
  assert.ok(!have.some((cursor) => cursor.taskId === "ended" || cursor.taskId === "orphan"));
  // One open stream fewer: the ended one gets the last place, the orphan none.
  const fewer = new PaneStore();
  fewer.applyBlock(done("0000000000000000", "ended", 3));
  for (let index = 0; index < MAX_JOIN_STREAMS - 1; index += 1) fewer.applyBlock(running(A, `t${index}`, index));
  fewer.applyBlock(done(null, "orphan", 2));
  assert.deepStrictEqual(fewer.have().at(-1), { callId: "0000000000000000", taskId: "ended", seq: 3, ended: true });
});

test("an ack's missing list is read up to MAX_JOIN_STREAMS entries, the rest counted", () => {
  const store = new PaneStore();
  store.applyBlock(running(A, "t", 1));
  const entry = { callId: A, taskId: "t", blocks: 1 };
  store.beginReplay();
  store.endReplay({ ok: true, replay: { missing: Array(MAX_JOIN_STREAMS).fill(entry) } });
  assert.equal(store.pane(A).tasks.get("t").missing, MAX_JOIN_STREAMS);
  assert.equal(store.dropped.ignoredAck, 0);
  store.beginReplay();
  store.endReplay({ ok: true, replay: { missing: Array(MAX_JOIN_STREAMS + 1).fill(entry) } });
  assert.equal(store.pane(A).tasks.get("t").missing, 2 * MAX_JOIN_STREAMS);
  assert.equal(store.dropped.ignoredAck, 1);
  // A huge list costs its bound, not its length.
  const huge = new Array(10_000_000);
  store.endReplay({ ok: true, replay: { missing: huge } });
  assert.equal(store.dropped.ignoredAck, 1 + 10_000_000);
  assert.equal(store.pane(A).mode, "live");
});

test("the missing notice's words, singular and plural, in both languages", () => {
  assert.equal(missingText(LABELS.en, 1), "1 earlier block is no longer available");
  assert.equal(missingText(LABELS.en, 12), "12 earlier blocks are no longer available");
  assert.equal(missingText(LABELS.zh, 12), "12 条较早的内容已不可用");
  assert.equal(missingText(labelsFor("en", { missing: "{n} gone ({n})" }), 3), "3 gone (3)");
});

class HeldAcks extends FakeSocket {
  // A socket whose acknowledgements the test gives (or never gives) itself.
  constructor() { super(); this.acks = []; }
  emit(name, data, ack) { this.emitted.push([name, data]); this.acks.push(ack); }
}

// attachSocket on a connected HeldAcks socket, the store holding `blocks`; what onJoin got.
function joined(blocks, options = {}) {
  const socket = new HeldAcks();
  const store = new PaneStore();
  for (const block of blocks) store.applyBlock(block);
  const acks = [];
  const onJoin = (ack) => { acks.push(ack); if (options.onJoin) options.onJoin(ack); };
  const detach = attachSocket(socket, store, { conversationId: "conv-1", tickMs: 0, ...options, onJoin });
  socket.connected = true;
  socket.fire("connect");
  return { socket, store, acks, detach };
}

test("attachSocket: panes are replay from the join until its ack, which applies missing", () => {
  const { socket, store, acks, detach } = joined([]);
  assert.deepStrictEqual(socket.emitted[0], ["join_conversation", { conversationId: "conv-1", have: [] }]);
  socket.fire("tool_event_stream", running(A, "t", 1));
  assert.equal(store.pane(A).mode, "replay"); // opened by a catch-up block
  socket.acks[0]({ ok: true, replay: { blocks: 1, streams: 1, missing: [{ callId: A, taskId: "t", blocks: 5 }] } });
  assert.equal(store.pane(A).mode, "live");
  assert.equal(store.pane(A).tasks.get("t").missing, 5);
  assert.equal(acks.length, 1);
  socket.fire("tool_event_stream", running(B, "u", 1));
  assert.equal(store.pane(B).mode, "live");
  // A reconnect: the join says what the store holds, the panes catch up again.
  socket.fire("connect");
  assert.deepStrictEqual(socket.emitted[1], ["join_conversation", {
    conversationId: "conv-1",
    have: [{ callId: A, taskId: "t", seq: 1 }, { callId: B, taskId: "u", seq: 1 }],
  }]);
  assert.deepStrictEqual(store.panes.map((pane) => pane.mode), ["replay", "replay"]);
  socket.acks[1]({ ok: true });
  assert.deepStrictEqual(store.panes.map((pane) => pane.mode), ["live", "live"]);
  detach();
});

test("attachSocket: a refused join leaves no pane in replay", () => {
  const { socket, store, acks, detach } = joined([running(A, "t", 1)]);
  assert.equal(store.pane(A).mode, "replay");
  socket.acks[0]({ ok: false, error: "forbidden" });
  assert.equal(store.pane(A).mode, "live");
  assert.deepStrictEqual(acks, [{ ok: false, error: "forbidden" }]);
  assert.equal(store.dropped.ignoredAck, 0);
  detach();
});

test("attachSocket: an unanswered join ends after joinTimeoutMs, its late answer is ignored", async () => {
  assert.equal(DEFAULT_JOIN_TIMEOUT_MS, 10000);
  let timedOut;
  const answered = new Promise((resolve) => { timedOut = resolve; });
  const { socket, store, acks, detach } = joined([running(A, "t", 1)], { joinTimeoutMs: 20, onJoin: () => timedOut() });
  assert.equal(store.pane(A).mode, "replay");
  await answered;
  assert.equal(store.pane(A).mode, "live");
  assert.deepStrictEqual(acks, [null]);
  socket.acks[0]({ ok: true, replay: { missing: [{ callId: A, taskId: "t", blocks: 5 }] } });
  assert.deepStrictEqual(acks, [null]);
  assert.equal(store.pane(A).tasks.get("t").missing, 0);
  detach();
});

test("attachSocket: a join superseded by a reconnect's is forgotten; detaching ends a catch-up", () => {
  const { socket, store, acks, detach } = joined([running(A, "t", 1)]);
  socket.fire("connect"); // reconnected before the first join was answered
  socket.acks[0]({ ok: true, replay: { missing: [{ callId: A, taskId: "t", blocks: 5 }] } });
  assert.equal(store.pane(A).mode, "replay"); // still waiting for the second join
  assert.deepStrictEqual(acks, []);
  socket.acks[1]({ ok: true });
  assert.equal(store.pane(A).mode, "live");
  assert.equal(store.pane(A).tasks.get("t").missing, 0);
  socket.fire("connect");
  assert.equal(store.pane(A).mode, "replay");
  detach();
  assert.equal(store.pane(A).mode, "live");
  socket.acks[2]({ ok: true });
  assert.deepStrictEqual(acks, [{ ok: true }]); // nothing reported after detaching
});

// The span link's address: tests/js/trace_urls.json, shared with kernel_ext.view.trace_url.
const traceUrlCases = JSON.parse(readFileSync(join(here, "trace_urls.json"), "utf8")).cases;
for (const { name, template, traceId, spanId, href } of traceUrlCases) {
  test(`traceUrl: ${name}`, () => {
    assert.equal(traceUrl(template ?? undefined, traceId ?? undefined, spanId), href);
  });
}
