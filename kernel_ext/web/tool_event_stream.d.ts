// TypeScript declarations of kernel_ext's tool_event_stream wire (namespace "/chat").
// Generated from the models of kernel_ext.protocol by `kernel-ext schema --typescript`:
// do not edit; regenerate it. Validate untrusted input with the JSON Schema
// (`kernel-ext schema`): these types describe, they do not check.

/**
 * The peer's progress object, passed through unchanged: unknown kinds and unknown fields are kept.
 */
export interface Envelope {
  /** envelope version, 1 (an integer, at least 1) */
  v?: number;
  /**
   * thinking, tool_call, text, tool_output_append, progress, or any other kind, kept as it is (1 to
   * 64 characters)
   */
  kind: string;
  /** the peer's stream; the task id in a pseudo-envelope (at most 512 characters) */
  streamKey: string;
  /** orders the blocks of one stream (an integer, at least 0) */
  seq: number;
  /** the peer's status word (at most 64 characters) */
  status: string;
  /**
   * the kind's content; a done block's text is the final answer, an aborted block's message a
   * summary (and its stopped, when true, says the user stopped the call: a stop, not a failure)
   */
  payload?: { [key: string]: unknown };
  [key: string]: unknown;
}

/**
 * One tool_event_stream message: an envelope attributed to a tool call. A done block carries the
 * final answer in envelope.payload.text, an aborted block a summary in envelope.payload.message.
 * Not expressed here, checked by the protocol's decoder: the size bound: a block's compact JSON is
 * at most 64 KiB of UTF-8 by default; payload values nested deeper than 32 levels; numbers a double
 * cannot hold (1e999, which a parser reads as infinity); ts and envelope.v written with a fraction
 * of zero (1.0): an integer to JSON Schema, refused by decode (seq and the block's v accept that
 * spelling).
 */
export interface Block {
  /** protocol version */
  v: 1;
  /**
   * the span id of the tool call's execute_tool span, 16 lower-case hex digits; null when it could
   * not be found without guessing (pattern /^[0-9a-f]{16}$/)
   */
  callId: string | null;
  /** the A2A task id; blocks made without an A2A task use the callId (1 to 512 characters) */
  taskId: string;
  /**
   * running: progress; done: the terminal, the final answer in envelope.payload.text; aborted: the
   * terminal, a summary in envelope.payload.message
   */
  state: "running" | "done" | "aborted";
  /** emit time at the caller, epoch milliseconds (an integer, at least 0) */
  ts: number;
  /** the peer's envelope, passed through unchanged */
  envelope: Envelope;
  /**
   * optional: the trace id of the tool call's execute_tool span, 32 lower-case hex digits, not all
   * zeros; absent or null when unknown, and never beside a null callId (pattern /^[0-9a-f]{32}$/)
   */
  traceId?: string | null;
}

/** A block's state: progress, or the stream's one terminal. */
export type BlockState = Block["state"];

/** `thinking`: the colleague's reasoning, shown folded. */
export interface ThinkingPayload {
  text?: string;
  [key: string]: unknown;
}

/**
 * `tool_call`: one line, the tool's name and a start marker. A peer sends `name` and `args`;
 * kernel_ext reports a tool call nested in a live one with `toolName`, `name` and that call's own
 * `callId`.
 */
export interface ToolCallPayload {
  name?: string;
  args?: unknown;
  toolName?: string;
  callId?: string;
  [key: string]: unknown;
}

/** `text`: a paragraph of the colleague's text. */
export interface TextPayload {
  text?: string;
  [key: string]: unknown;
}

/** `tool_output_append`: appended to a terminal-style output area (not produced in v1). */
export interface ToolOutputAppendPayload {
  text?: string;
  [key: string]: unknown;
}

/**
 * `progress`: a progress bar. `progress` so far out of `total` (absent when the total is unknown:
 * an indeterminate bar), and a `message` shown with it (an MCP server's `notifications/progress`,
 * through :mod:`kernel_ext.integrations.mcp`).
 */
export interface ProgressPayload {
  progress?: number;
  total?: number;
  message?: string;
  [key: string]: unknown;
}

/** The payload of a `done` block: the final answer. */
export interface DonePayload {
  text: string;
  [key: string]: unknown;
}

/** The payload of an `aborted` block: why the stream ended without an answer. */
export interface AbortedPayload {
  message: string;
  [key: string]: unknown;
}

/** An envelope of the known kind `thinking`. */
export interface ThinkingEnvelope extends Envelope {
  kind: "thinking";
  payload?: ThinkingPayload;
}

/** An envelope of the known kind `tool_call`. */
export interface ToolCallEnvelope extends Envelope {
  kind: "tool_call";
  payload?: ToolCallPayload;
}

/** An envelope of the known kind `text`. */
export interface TextEnvelope extends Envelope {
  kind: "text";
  payload?: TextPayload;
}

/** An envelope of the known kind `tool_output_append`. */
export interface ToolOutputAppendEnvelope extends Envelope {
  kind: "tool_output_append";
  payload?: ToolOutputAppendPayload;
}

/** An envelope of the known kind `progress`. */
export interface ProgressEnvelope extends Envelope {
  kind: "progress";
  payload?: ProgressPayload;
}

/** An envelope of one of the known kinds; any other kind is an `Envelope`. */
export type KnownEnvelope =
  | ThinkingEnvelope
  | ToolCallEnvelope
  | TextEnvelope
  | ToolOutputAppendEnvelope
  | ProgressEnvelope;
export type KnownKind = KnownEnvelope["kind"];

/** A `running` block: progress of its stream. */
export interface RunningBlock extends Block {
  state: "running";
}

/** A `done` block: the one terminal of its stream. */
export interface DoneBlock extends Block {
  state: "done";
  envelope: Envelope & { payload: DonePayload };
}

/** An `aborted` block: the one terminal of its stream. */
export interface AbortedBlock extends Block {
  state: "aborted";
  envelope: Envelope & { payload: AbortedPayload };
}

/** One `tool_event_stream` message, told apart by `state`. */
export type ToolEventStreamBlock = RunningBlock | DoneBlock | AbortedBlock;

/** One stream a browser already holds part of, in a join's `have`. */
export interface StreamCursor {
  /** the stream's callId; null for the final answer of a call without one */
  callId: string | null;
  taskId: string;
  /** the highest seq held, the stream's items' and terminal's (an integer, 0 to 2**53 - 1) */
  seq: number;
  /** true when the stream's terminal is held (its seq need not be the highest: a colleague's blocks carry its own seqs); the relay then sends nothing more of the stream */
  ended?: boolean;
}

/** What `join_conversation` sends. */
export interface JoinRequest {
  /** the conversation id, the room to join */
  conversationId: string;
  /**
   * per stream, the highest seq the browser holds: a relay that catches up sends only the blocks
   * above it (without an entry, all it holds of that stream); at most 1,000 entries are read
   */
  have?: StreamCursor[];
}

/** A stream of which the relay no longer held blocks the browser lacks. */
export interface MissingBlocks {
  callId: string | null;
  taskId: string;
  /** how many (at most), at least 1 */
  blocks: number;
}

/** What a join's catch-up sent; absent from a relay that keeps nothing. */
export interface Replay {
  /** blocks sent to this browser before the answer */
  blocks: number;
  /** streams they belong to */
  streams: number;
  /** absent or empty when nothing is missing */
  missing?: MissingBlocks[];
  /**
   * true when the connection's catch-up budget stopped the catch-up: what was not sent is in
   * `missing` (the browser is in the room all the same). Also sent to a join without `have`. A
   * renderer that re-joins with `have` sends only what it lacks and stays within the budget
   */
  limited?: true;
}

/** What `join_conversation` answers. */
export type JoinAnswer = { ok: true; replay?: Replay } | { ok: false; error: string };

/** What `stop_call` sends: stop one running call of a room the browser joined. */
export interface StopRequest {
  v: 1;
  /** the conversation id, a room this browser joined */
  room: string;
  /** the call to stop: its callId (16 lower-case hex digits) */
  callId: string;
}

/**
 * How a relay answers a stop: `stopping` (the worker was asked; the call's terminal follows),
 * `already_ended`, `unknown` (no running call with that callId in that room), `refused` (not
 * joined, the application's hook said no, or rate-limited), `unreachable` (no worker reachable: the
 * pane ends as a gone worker's does)
 */
export type StopAnswerWord = "stopping" | "already_ended" | "unknown" | "refused" | "unreachable";

/** What `stop_call` answers; anything else is a failure. */
export interface StopAnswer {
  answer: StopAnswerWord;
  /** a short text saying why, when the relay gives one */
  reason?: string;
}

/** What `leave_conversation` answers (and `join_conversation` without `replay`). */
export type RoomAnswer = { ok: true } | { ok: false; error: string };

/**
 * Events a browser receives in namespace "/chat" (socket.io-client: `Socket<ServerToClientEvents,
 * ClientToServerEvents>`).
 */
export interface ServerToClientEvents {
  tool_event_stream: (block: ToolEventStreamBlock) => void;
  /** The kernel's own tool-event snapshot, passed through unchanged. */
  chat_event: (event: { [key: string]: unknown }) => void;
}

/** Events a browser sends in namespace "/chat", each acknowledged. */
export interface ClientToServerEvents {
  join_conversation: (
    request: JoinRequest,
    ack: (answer: JoinAnswer) => void,
  ) => void;
  leave_conversation: (
    request: { conversationId: string },
    ack: (answer: RoomAnswer) => void,
  ) => void;
  stop_call: (
    request: StopRequest,
    ack: (answer: StopAnswer) => void,
  ) => void;
}

/** A pane's mode: `replay` from a join until its answer, `live` otherwise. */
export type PaneMode = "live" | "replay";

/** A pane's status (`PaneStore.state()` in renderer.js; kernel_ext.viewing.view). */
export type PaneStatus = "calling" | "streaming" | "ended" | "no_details";

/** One rendered block of a task in the pane state. */
export type PaneItem =
  | { kind: "thinking"; seq: number; text: string; folded: true }
  | { kind: "tool_call"; seq: number; tool: string | null }
  | { kind: "text" | "tool_output_append"; seq: number; text: string }
  | {
      kind: "progress";
      seq: number;
      progress: number | null;
      total: number | null;
      text: string | null;
    }
  | { kind: "other"; envelopeKind: string; seq: number; text: string | null };

/** A pinned final answer. */
export interface PaneFinal {
  from: "done" | "aborted" | "toolReturn";
  taskId: string | null;
  text: string;
}

/** One stream of a pane: one taskId of its call. */
export interface PaneTask {
  taskId: string;
  ended: boolean;
  outcome: "done" | "aborted" | null;
  final: string | null;
  /** blocks the relay could no longer send (its join answers' `replay.missing`) */
  missing: number;
  items: PaneItem[];
}

/** The detail pane of one tool call. */
export interface PaneState {
  callId: string;
  /** the call's trace id, from the first block that carried a valid one */
  traceId: string | null;
  mode: PaneMode;
  tool: string | null;
  status: PaneStatus;
  returned: boolean;
  final: PaneFinal | null;
  tasks: PaneTask[];
}

/** The final answer of a call without a callId. */
export interface OrphanState {
  taskId: string;
  outcome: "done" | "aborted";
  text: string;
}

/** A room's panes: `PaneStore.state()`, the conformance vectors' format. */
export interface PaneStoreState {
  panes: PaneState[];
  orphans: OrphanState[];
  /** inputs that changed nothing, by reason */
  dropped: {
    invalid: number;
    duplicate: number;
    afterEnd: number;
    unattributed: number;
    ignoredSnapshot: number;
    ignoredAck: number;
  };
}
