// Every conformance vector in tests/vectors through kernel_ext/web/renderer.js (node --test).
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { PaneStore, LABELS, labelsFor, attachSocket, DEFAULT_TIMEOUT_MS } from "../../kernel_ext/web/renderer.js";

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
    } else if (key === "expect") checkpoints.push([index, store.state()]);
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
    for (const [index, state] of checkpoints) {
      assert.deepStrictEqual(state, vector.steps[index].expect, `checkpoint at step ${index}`);
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
  assert.deepStrictEqual(socket.emitted, [["join_conversation", { conversationId: "conv-1" }], ["join_conversation", { conversationId: "conv-1" }]]);
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
