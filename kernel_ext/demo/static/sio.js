// A small Socket.IO client for the demo page: Socket.IO protocol 5 over Engine.IO 4, WebSocket
// transport only, JSON payloads only (no binary), one namespace per connection. It is what the
// page needs from socket.io-client, without a build step or a download.
//
//   const socket = connect("/chat", { auth: null });
//   socket.on("connect", () => ...); socket.on("tool_event_stream", (block) => ...);
//   socket.emit("join_conversation", { conversationId }, (ack) => ...);
//   const ack = await socket.request("user_message", data, 10000);   // rejects on timeout
//
// Guarantees: reconnects after a dropped connection with a delay doubling from 1 s to 5 s
// (listeners get "disconnect", then "connect" again: re-join rooms there); a connection that
// misses the server's pings is dropped; an acknowledgement callback runs at most once; a
// malformed packet is ignored; emit() while disconnected sends nothing and returns false.

const OPEN = "0", CLOSE = "1", PING = "2", PONG = "3", MESSAGE = "4";
const CONNECT = "0", DISCONNECT = "1", EVENT = "2", ACK = "3", CONNECT_ERROR = "4";
const RESERVED = new Set(["connect", "disconnect", "connect_error"]);

export function connect(namespace = "/", options = {}) {
  return new Socket(namespace, options);
}

export class Socket {
  constructor(namespace, { path = "/socket.io/", auth = null, url = null, reconnectDelay = 1000, reconnectDelayMax = 5000 } = {}) {
    this.namespace = namespace;
    this.auth = auth;
    const base = new URL(url || globalThis.location.href);
    const scheme = base.protocol === "https:" ? "wss:" : "ws:";
    this.endpoint = `${scheme}//${base.host}${path}?EIO=4&transport=websocket`;
    this.reconnectDelay = reconnectDelay;
    this.reconnectDelayMax = reconnectDelayMax;
    this.connected = false;
    this.id = null;
    this._listeners = new Map();
    this._acks = new Map();
    this._nextAck = 0;
    this._delay = reconnectDelay;
    this._closed = false;
    this._ws = null;
    this._pingTimer = null;
    this._retryTimer = null;
    this._open();
  }

  on(event, listener) {
    if (!this._listeners.has(event)) this._listeners.set(event, new Set());
    this._listeners.get(event).add(listener);
    return this;
  }

  off(event, listener) {
    const set = this._listeners.get(event);
    if (set) set.delete(listener);
    return this;
  }

  /** Send an event; a function as last argument asks for the server's acknowledgement. */
  emit(event, ...args) {
    if (!this.connected) return false;
    let id = "";
    if (args.length && typeof args[args.length - 1] === "function") {
      const callback = args.pop();
      id = String(this._nextAck++);
      this._acks.set(id, callback);
    }
    this._send(MESSAGE + EVENT + this._prefix() + id + JSON.stringify([event, ...args]));
    return true;
  }

  /** Send an event and resolve with its acknowledgement; reject when not connected, on
   * disconnect, or after timeoutMs. */
  request(event, data, timeoutMs = 10000) {
    return new Promise((resolve, reject) => {
      let settled = false;
      const timer = setTimeout(() => finish(null, new Error("no acknowledgement in time")), timeoutMs);
      const finish = (value, error) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        this.off("disconnect", onDisconnect);
        if (error) reject(error);
        else resolve(value);
      };
      const onDisconnect = () => finish(null, new Error("disconnected"));
      this.on("disconnect", onDisconnect);
      if (!this.emit(event, data, (ack) => finish(ack, null))) finish(null, new Error("not connected"));
    });
  }

  close() {
    this._closed = true;
    clearTimeout(this._retryTimer);
    if (this._ws) this._ws.close();
  }

  // -- internals --------------------------------------------------------------------------

  _prefix() {
    return this.namespace === "/" ? "" : `${this.namespace},`;
  }

  _fire(event, ...args) {
    for (const listener of Array.from(this._listeners.get(event) || [])) {
      try {
        listener(...args);
      } catch (error) {
        console.error(`socket listener for ${event} failed`, error);
      }
    }
  }

  _send(text) {
    if (this._ws && this._ws.readyState === WebSocket.OPEN) this._ws.send(text);
  }

  _open() {
    const ws = (this._ws = new WebSocket(this.endpoint));
    ws.onmessage = (message) => {
      if (typeof message.data === "string") this._onPacket(message.data);
    };
    ws.onclose = () => this._onClose(ws);
    ws.onerror = () => ws.close();
  }

  _onClose(ws) {
    if (ws !== this._ws) return;
    clearTimeout(this._pingTimer);
    this._ws = null;
    this._acks.clear();
    if (this.connected) {
      this.connected = false;
      this._fire("disconnect");
    }
    if (this._closed) return;
    this._retryTimer = setTimeout(() => this._open(), this._delay);
    this._delay = Math.min(this._delay * 2, this.reconnectDelayMax);
  }

  _watchPings(interval, timeout) {
    clearTimeout(this._pingTimer);
    this._pingTimer = setTimeout(() => this._ws && this._ws.close(), interval + timeout);
  }

  _onPacket(text) {
    const type = text[0];
    if (type === OPEN) {
      let handshake;
      try {
        handshake = JSON.parse(text.slice(1));
      } catch {
        return;
      }
      this._pingInterval = Number(handshake.pingInterval) || 25000;
      this._pingTimeout = Number(handshake.pingTimeout) || 20000;
      this._watchPings(this._pingInterval, this._pingTimeout);
      const auth = this.auth === null ? "" : JSON.stringify(this.auth);
      this._send(MESSAGE + CONNECT + this._prefix() + auth);
    } else if (type === PING) {
      this._watchPings(this._pingInterval, this._pingTimeout);
      this._send(PONG);
    } else if (type === CLOSE) {
      if (this._ws) this._ws.close();
    } else if (type === MESSAGE) {
      this._onMessage(text.slice(1));
    }
  }

  _onMessage(text) {
    const type = text[0];
    let rest = text.slice(1);
    let namespace = "/";
    if (rest[0] === "/") {
      const comma = rest.indexOf(",");
      namespace = comma < 0 ? rest : rest.slice(0, comma);
      rest = comma < 0 ? "" : rest.slice(comma + 1);
    }
    if (namespace !== this.namespace) return;
    const digits = /^\d*/.exec(rest)[0];
    let payload = null;
    if (rest.length > digits.length) {
      try {
        payload = JSON.parse(rest.slice(digits.length));
      } catch {
        return;
      }
    }
    if (type === CONNECT) {
      this.id = payload && payload.sid;
      this.connected = true;
      this._delay = this.reconnectDelay;
      this._fire("connect");
    } else if (type === CONNECT_ERROR) {
      this._fire("connect_error", payload);
      if (this._ws) this._ws.close();
    } else if (type === DISCONNECT) {
      if (this._ws) this._ws.close();
    } else if (type === EVENT && Array.isArray(payload) && typeof payload[0] === "string" && !RESERVED.has(payload[0])) {
      const [event, ...args] = payload;
      if (digits) {
        // The server asked for an acknowledgement: this page has nothing to say back.
        this._send(MESSAGE + ACK + this._prefix() + digits + "[]");
      }
      this._fire(event, ...args);
    } else if (type === ACK && digits && Array.isArray(payload)) {
      const callback = this._acks.get(digits);
      this._acks.delete(digits);
      if (callback) callback(...payload);
    }
  }
}
