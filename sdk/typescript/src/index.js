// forkd's TypeScript/JavaScript SDK: the controller daemon (`forkd serve`) over its Unix
// socket or TCP with a bearer token. No runtime dependencies (node:http only), Node >= 20.
// Types: index.d.ts, and api.d.ts generated from forkd.controller.api (docs/api.md).

import fs from "node:fs";
import http from "node:http";
import https from "node:https";
import path from "node:path";

// Deadlines (docs/api.md, "Timeouts"): the same as the Python client's.
export const CONNECT_TIMEOUT_S = 10;
export const REQUEST_TIMEOUT_S = 600;
export const ANSWER_GRACE_S = 60;
export const HEARTBEAT_S = 15;
export const EVAL_TIMEOUT_S = 300;
// What one answer may hold in this process at most (the Python client's bounds,
// forkd.controller.client): a command's result, an error, a streamed frame. Whatever
// answers at the URL (another server, a proxy, a daemon gone wrong) sending more, or a
// line without end, held all of it in memory.
export const MAX_ANSWER_BYTES = 256 * 1024 * 1024;
export const MAX_ERROR_BYTES = 1024 * 1024;
export const MAX_FRAME_BYTES = 1024 * 1024;
// a file read whole (files.read): the most a guest sends of one file (docs/api.md)
export const MAX_FILE_BYTES = 4 * 1024 * 1024 * 1024;
const MAX_EXIT_CODE = 125; // past it a shell reads "not executable", "not found" or a signal

/** The daemon answered with an error: `type` is its family, `exitCode` forkd's. */
export class ForkdError extends Error {
  constructor(message, { type = "ForkdError", exitCode = 1, status = 0 } = {}) {
    super(message);
    this.name = type;
    this.type = type;
    this.exitCode = exitCode;
    this.status = status;
  }
}
export class InvalidInput extends ForkdError {}
export class NotFound extends ForkdError {}
export class Conflict extends ForkdError {}
export class IntegrityError extends ForkdError {}
const FAMILIES = { InvalidInput, NotFound, Conflict, IntegrityError, ChainError: IntegrityError };

/** Some of the sandboxes asked for did not start; the ones that did were killed. */
export class SpawnError extends ForkdError {
  constructor(asked, errors) {
    super(`${errors.length} of ${asked} sandboxes did not start:\n${errors.slice(0, 5).join("\n")}`,
      { type: "SpawnError" });
    this.errors = errors;
  }
}

// A sandbox id and a process handle go into a URL's path, where "..", "/", "?" or "#"
// would send the request to another route ("../snapshots/T" made a kill a snapshot's
// delete): they are checked here, as the daemon checks them (docs/api.md).
const ID_RE = /^[a-z0-9][a-z0-9-]{0,63}$/;
const HANDLE_RE = /^p[0-9]{1,19}$/;

function checkedId(id) {
  if (typeof id !== "string" || !ID_RE.test(id)) {
    throw new InvalidInput(`invalid sandbox id ${JSON.stringify(String(id)).slice(0, 80)}: ids are `
      + "1-64 of a-z, 0-9 and '-'; GET /v1/sandboxes lists them", { type: "InvalidInput" });
  }
  return id;
}

function checkedHandle(handle) {
  if (typeof handle !== "string" || !HANDLE_RE.test(handle)) {
    throw new InvalidInput(`invalid process handle ${JSON.stringify(String(handle)).slice(0, 80)}: `
      + "handles are p1, p2, ... as processes gave them", { type: "InvalidInput" });
  }
  return handle;
}

function shownUrl(url) {
  const shown = new URL(url.href);
  if (shown.username || shown.password) { shown.username = "***"; shown.password = ""; }
  return shown.href;
}

// The error a daemon answered, as its family; an answer of any other shape (not JSON, no
// error object, a type that is not a family's) is a plain ForkdError, never thrown while
// it is read: a body without `error` (a proxy's) threw in the answer's "end" handler,
// which ended the whole Node process, and a type "constructor" rejected with a String.
function errorOf(status, text) {
  let body = null;
  try {
    body = JSON.parse(text)?.error;
  } catch {
    // not JSON: said below
  }
  if (body === null || typeof body !== "object" || typeof body.type !== "string"
      || typeof body.message !== "string") {
    return new ForkdError(`controller answered ${status}: ${text.slice(0, 200)}`, { status });
  }
  const Family = Object.hasOwn(FAMILIES, body.type) ? FAMILIES[body.type] : ForkdError;
  return new Family(body.message, { type: body.type, exitCode: failureExitCode(body.exit_code), status });
}

// A failure's exit code as the daemon gave it, when a failed command may exit with it (1 to
// 125), else 1: 0 (or 256, a shell's 0) would say a failed request worked.
function failureExitCode(code) {
  return Number.isInteger(code) && code >= 1 && code <= MAX_EXIT_CODE ? code : 1;
}

function tooLarge(where, what, limit) {
  return new ForkdError(`controller at ${where} answered ${what} with more than ${limit} bytes; `
    + "no forkd daemon answers that much: is the URL a forkd daemon's?");
}

// Reads `res` whole, up to `limit` bytes (the connection is ended past it: `fail`).
function collected(res, limit, fail, done) {
  const parts = [];
  let size = 0;
  res.on("data", (c) => {
    size += c.length;
    if (size > limit) { res.destroy(); fail(); return; }
    parts.push(c);
  });
  res.on("end", () => { if (size <= limit) done(Buffer.concat(parts)); });
}

// Credentials (the bearer token, a password in the URL) over plain http:// to another host
// than this one (loopback) are refused unless the caller opts in (plainHttp): anyone on the
// path reads them and drives the daemon with them (the Python client's check_plain_http).
function checkPlainHttp(url, token, plainHttp) {
  if (plainHttp || url.protocol !== "http:" || !(token || url.username || url.password)) return;
  const host = unbracketed(url.hostname);
  if (host === "localhost" || isLoopback(host)) return;
  throw new InvalidInput(`refusing to send the bearer token over plain http:// to ${shownUrl(url)}: `
    + "anyone on the path can read it and drive the daemon; use https:// (TLS in front of "
    + "`forkd serve --listen`), an SSH tunnel to 127.0.0.1, or pass plainHttp: true if every "
    + "network between here and there is yours", { type: "InvalidInput" });
}

function unbracketed(hostname) {
  return hostname.replace(/^\[(.*)\]$/, "$1");
}

// 127.0.0.0/8, ::1, or an IPv4-mapped loopback (::ffff:7f00:1, as URL writes ::ffff:127.0.0.1)
function isLoopback(host) {
  if (/^127\.\d+\.\d+\.\d+$/.test(host)) return true;
  if (host === "::1") return true;
  const mapped = /^::ffff:([0-9a-f]{1,4}):[0-9a-f]{1,4}$/.exec(host);
  return mapped !== null && (parseInt(mapped[1], 16) >> 8) === 127;
}

// $FORKD_RUN with forkd's defaults (engine/paths.py), and how many of its last levels
// are forkd's own (forkd.private): [directory, ownedLevels].
function runLocation() {
  const env = process.env;
  if (env.FORKD_RUN) return [path.resolve(env.FORKD_RUN), 1];
  const uid = process.geteuid?.() ?? 0;
  if (uid === 0) return ["/run/forkd", 1];
  if (env.XDG_RUNTIME_DIR) return [path.resolve(env.XDG_RUNTIME_DIR, "forkd"), 1];
  return [path.join("/tmp", `forkd-${uid}`, "forkd"), 2];
}

/** $FORKD_RUN/controller.sock, with forkd's defaults for $FORKD_RUN (engine/paths.py). */
export function defaultSocket() {
  return path.join(runLocation()[0], "controller.sock");
}

const GROUP_OTHER_WRITE = 0o022;

function notPrivate(where, why) {
  return new InvalidInput(`${where} ${why}: forkd keeps its socket there and trusts only a `
    + "directory of yours with mode 0700 (and a socket of yours in it); remove it (or fix its "
    + "owner and mode) and retry, or point FORKD_RUN at a directory of your own",
  { type: "InvalidInput" });
}

// The daemon's socket at the default place is connected to only when nobody else could have
// put it there (forkd.private's check of $FORKD_RUN, as the Python client makes): forkd's
// levels of $FORKD_RUN are real directories of this user that group and others cannot
// write, the ones above them (resolved) are root's or this user's (writable by others only
// when sticky), and the socket is this user's. Otherwise another local user who made
// /tmp/forkd-UID first (or a FORKD_RUN others may write) answered as the daemon: was sent
// every command, file and cell, and answered what it liked.
function checkedDefaultSocket(socket) {
  const uid = process.geteuid?.() ?? 0;
  const [run, owned] = runLocation();
  const levels = [];
  for (let level = run; ; level = path.dirname(level)) {
    levels.unshift(level);
    if (level === path.dirname(level)) break;
  }
  levels.forEach((level, depth) => {
    if (depth >= levels.length - owned) {
      const st = fs.lstatSync(level, { throwIfNoEntry: false });
      if (!st) return; // no daemon made it: the connection is refused below
      if (st.isSymbolicLink()) throw notPrivate(level, "is a symlink");
      if (!st.isDirectory()) throw notPrivate(level, "is not a directory");
      if (st.uid !== uid) throw notPrivate(level, `is owned by uid ${st.uid}, not by you (uid ${uid})`);
      if (st.mode & GROUP_OTHER_WRITE) throw notPrivate(level, "is writable by group or others");
      return;
    }
    const link = fs.lstatSync(level, { throwIfNoEntry: false });
    if (!link) return;
    if (link.isSymbolicLink() && link.uid !== 0 && link.uid !== uid) {
      throw notPrivate(level, `is a symlink owned by uid ${link.uid}, who could re-point it`);
    }
    const real = fs.realpathSync(level);
    for (let up = real; ; up = path.dirname(up)) {
      const st = fs.statSync(up);
      if (st.uid !== 0 && st.uid !== uid) throw notPrivate(up, `is owned by uid ${st.uid}`);
      if ((st.mode & GROUP_OTHER_WRITE) && !(st.mode & 0o1000)) {
        throw notPrivate(up, "is writable by group or others and not sticky");
      }
      if (up === path.dirname(up)) break;
    }
  });
  const st = fs.lstatSync(socket, { throwIfNoEntry: false });
  if (st && st.uid !== uid) throw notPrivate(socket, `is owned by uid ${st.uid}, not by you (uid ${uid})`);
  return socket;
}

function answerTimeout(commandTimeout) {
  return commandTimeout == null ? null : commandTimeout + ANSWER_GRACE_S;
}

export class Controller {
  /**
   * @param {{url?: string, token?: string, socket?: string, timeout?: number}} [options]
   * url: http(s)://HOST:PORT (then token is required by the daemon); else the Unix socket.
   * timeout: seconds for requests that run no command (default REQUEST_TIMEOUT_S).
   * plainHttp: send the token over http:// to another host than this one (refused
   * otherwise: checkPlainHttp).
   */
  constructor({ url, token, socket, timeout = REQUEST_TIMEOUT_S, plainHttp = false } = {}) {
    this.url = url ? new URL(url) : null;
    if (this.url) checkPlainHttp(this.url, token, plainHttp);
    this.socket = this.url ? null : (socket ?? defaultSocket());
    this.checked = !this.url && socket == null; // the default socket: checked at each connection
    this.token = token ?? null;
    this.timeout = timeout;
    this.where = this.url ? shownUrl(this.url) : this.socket; // in messages: no password
  }

  _open(method, route, { query, body, raw, wait }, onResponse, reject) {
    const qs = query ? `?${new URLSearchParams(query)}` : "";
    const headers = {};
    if (this.token) headers.authorization = `Bearer ${this.token}`;
    let payload = null;
    if (raw !== undefined) {
      payload = Buffer.from(raw);
      headers["content-type"] = "application/octet-stream";
    } else if (body !== undefined) {
      payload = Buffer.from(JSON.stringify(body));
      headers["content-type"] = "application/json";
    }
    if (payload) headers["content-length"] = String(payload.length);
    const options = { method, headers, path: route + qs };
    let client = http;
    if (this.url) {
      // an IPv6 literal's brackets are the URL's, not the address's (node:http looked
      // "[::1]" up as a name: ENOTFOUND)
      Object.assign(options, { hostname: unbracketed(this.url.hostname), port: this.url.port });
      options.path = this.url.pathname.replace(/\/$/, "") + route + qs;
      if (this.url.protocol === "https:") client = https;
    } else {
      options.socketPath = this.checked ? checkedDefaultSocket(this.socket) : this.socket;
    }
    const req = client.request(options, onResponse);
    const connect = setTimeout(() => req.destroy(new ForkdError(
      `controller at ${this.where} did not accept a connection in ${CONNECT_TIMEOUT_S} s`)),
      CONNECT_TIMEOUT_S * 1000);
    req.on("socket", (sock) => {
      if (sock.connecting) sock.once("connect", () => clearTimeout(connect));
      else clearTimeout(connect); // a kept-alive socket, connected already
    });
    if (wait != null) {
      req.setTimeout(wait * 1000, () => req.destroy(new ForkdError(
        `controller at ${this.where} did not answer ${method} ${route} in ${wait} s; ` +
        "the request may still be running there")));
    }
    req.on("error", (err) => {
      clearTimeout(connect);
      reject(err instanceof ForkdError ? err : new ForkdError(
        `controller at ${this.where} unreachable: ${err.message}; is \`forkd serve\` running?`));
    });
    req.end(payload ?? undefined);
    return req;
  }

  /**
   * One request; resolves to the answer's bytes (a Buffer), rejects with its error. An
   * answer is read up to `limit` bytes (MAX_ANSWER_BYTES), an error up to MAX_ERROR_BYTES.
   */
  request(method, route, { query, body, raw, wait = this.timeout, limit = MAX_ANSWER_BYTES } = {}) {
    return new Promise((resolve, reject) => {
      this._open(method, route, { query, body, raw, wait }, (res) => {
        const failed = res.statusCode >= 400;
        const most = failed ? MAX_ERROR_BYTES : limit;
        res.on("error", reject);
        collected(res, most, () => reject(tooLarge(this.where, `${method} ${route}`, most)),
          (data) => (failed ? reject(errorOf(res.statusCode, data.toString())) : resolve(data)));
      }, reject);
    });
  }

  async json(method, route, options = {}) {
    const data = await this.request(method, route, options);
    if (!data.length) return null;
    try {
      return JSON.parse(data.toString());
    } catch {
      throw new ForkdError(`controller at ${this.where} answered ${method} ${route} with `
        + "something that is not JSON; is it another forkd version?");
    }
  }

  /** NDJSON frames of a streamed route, as they arrive (an async iterator). */
  async *stream(route, body) {
    const lines = [];
    let wake = null;
    let done = false;
    let failure = null;
    const push = () => { if (wake) { wake(); wake = null; } };
    await new Promise((started, reject) => {
      this._open("POST", route, { body, wait: 4 * HEARTBEAT_S }, (res) => {
        if (res.statusCode >= 400) {
          res.on("error", reject);
          collected(res, MAX_ERROR_BYTES,
            () => reject(tooLarge(this.where, route, MAX_ERROR_BYTES)),
            (data) => reject(errorOf(res.statusCode, data.toString())));
          return;
        }
        // a line is parsed here, in the answer's "data" handler: what it throws (a line
        // that is not JSON, one past MAX_FRAME_BYTES) ends this stream, never the process
        const broken = (message) => {
          failure = new ForkdError(`controller at ${this.where} sent ${route} ${message}; `
            + "is the URL a forkd daemon's, of this version?");
          res.destroy();
          push();
        };
        let pending = [];
        let pendingSize = 0;
        res.on("data", (chunk) => {
          if (failure) return;
          let start = 0;
          let nl;
          while ((nl = chunk.indexOf(10, start)) >= 0) {
            const line = Buffer.concat([...pending, chunk.subarray(start, nl)]).toString();
            pending = [];
            pendingSize = 0;
            start = nl + 1;
            if (!line) continue;
            try {
              lines.push(JSON.parse(line));
            } catch {
              broken("a line that is not JSON");
              return;
            }
          }
          pending.push(chunk.subarray(start));
          pendingSize += chunk.length - start;
          if (pendingSize > MAX_FRAME_BYTES) {
            broken(`a line of more than ${MAX_FRAME_BYTES} bytes`);
            return;
          }
          push();
        });
        res.on("end", () => { done = true; push(); });
        res.on("error", (err) => { failure = err; push(); });
        started();
      }, (err) => { failure = err; push(); reject(err); });
    });
    for (;;) {
      if (lines.length) {
        const frame = lines.shift();
        if (frame === null || typeof frame !== "object") {
          throw new ForkdError(`controller at ${this.where} sent ${route} a line that is not a frame`);
        }
        if (frame.error) throw errorOf(500, JSON.stringify({ error: frame.error }));
        yield frame;
        if (frame.result) return;
        continue;
      }
      if (failure) throw failure;
      if (done) throw new ForkdError(`controller at ${this.where} ended ${route} before the result`);
      await new Promise((r) => { wake = r; });
    }
  }

  snapshots() { return this.json("GET", "/v1/snapshots"); }

  /** The daemon's sandboxes (as Sandbox objects). */
  async sandboxes() {
    const infos = await this.json("GET", "/v1/sandboxes");
    return infos.map((info) => new Sandbox(this, info.id));
  }

  /** Fork n sandboxes of tag: all of them, or SpawnError (the started ones are killed). */
  async spawnSandboxes(tag, n = 1, options = {}) {
    const result = await this.json("POST", "/v1/sandboxes", { body: { tag, n, ...options } });
    const started = result.sandboxes.map((s) => new Sandbox(this, s.id));
    if (result.errors.length || started.length !== n) {
      await Promise.allSettled(started.map((sb) => sb.kill()));
      throw new SpawnError(n, result.errors.length ? result.errors : ["missing, no error given"]);
    }
    return started;
  }

  branchSandbox(sandboxId, tag, { force = false } = {}) {
    return this.json("POST", `/v1/sandboxes/${checkedId(sandboxId)}/branch`,
      { body: { tag, force } });
  }
}

class CommandHandle {
  constructor(sandbox, info) {
    this.sandbox = sandbox;
    this.handle = checkedHandle(info.handle);
    this.pid = info.pid;
    this.argv = info.argv;
  }

  get _route() { return `/v1/sandboxes/${this.sandbox.id}/processes/${this.handle}`; }

  /** Its result once it ends, or null when it still runs after `timeout` seconds. */
  async wait({ timeout = null } = {}) {
    const r = await this.sandbox.controller.json("POST", `${this._route}/wait`,
      { body: { timeout }, wait: answerTimeout(timeout) });
    return r.running ? null : r;
  }

  sendStdin(data, { close = false } = {}) {
    const b64 = Buffer.from(data).toString("base64");
    return this.sandbox.controller.json("POST", `${this._route}/stdin`,
      { body: { data_b64: b64, close } });
  }

  closeStdin() {
    return this.sandbox.controller.json("POST", `${this._route}/stdin`, { body: { close: true } });
  }

  kill(signal = "SIGKILL") {
    return this.sandbox.controller.json("POST", `${this._route}/kill`, { body: { signal } });
  }
}

function argvOf(cmd) {
  return typeof cmd === "string" ? ["/bin/sh", "-c", cmd] : [...cmd];
}

class Commands {
  constructor(sandbox) { this.sandbox = sandbox; }

  /**
   * Run a command to its end (a string goes through /bin/sh -c); never rejects for a
   * non-zero exit. timeout (s): it is killed then; none: no deadline at all.
   * onStdout/onStderr: called with the output as it is produced (streamed).
   * background: true starts it and resolves to a CommandHandle at once.
   */
  async run(cmd, { env, cwd, stdin, timeout, onStdout, onStderr, background = false } = {}) {
    if (background) return this.start(cmd, { env, cwd, stdin });
    const body = { argv: argvOf(cmd), env, cwd, timeout };
    if (stdin != null) body.stdin_b64 = Buffer.from(stdin).toString("base64");
    const ctl = this.sandbox.controller;
    const route = `/v1/sandboxes/${this.sandbox.id}/exec`;
    if (!onStdout && !onStderr) {
      return ctl.json("POST", route, { body, wait: answerTimeout(timeout ?? null) });
    }
    for await (const frame of ctl.stream(`${route}/stream`, body)) {
      if (frame.stdout && onStdout) onStdout(frame.stdout);
      if (frame.stderr && onStderr) onStderr(frame.stderr);
      if (frame.result) return frame.result;
    }
    throw new ForkdError("the command's stream ended without a result");
  }

  /** Start a command in the background: a CommandHandle. */
  async start(cmd, { env, cwd, stdin, pty = false } = {}) {
    const body = { argv: argvOf(cmd), env, cwd, pty };
    if (stdin != null) body.stdin_b64 = Buffer.from(stdin).toString("base64");
    const info = await this.sandbox.controller.json("POST",
      `/v1/sandboxes/${this.sandbox.id}/processes`, { body });
    return new CommandHandle(this.sandbox, info);
  }

  /** The background commands: running, or ended and not waited for. */
  list() { return this.sandbox.controller.json("GET", `/v1/sandboxes/${this.sandbox.id}/processes`); }
}

class Files {
  constructor(sandbox) { this.sandbox = sandbox; }

  /** The file's bytes (a Buffer); rejects with NotFound when there is none. */
  read(file) {
    return this.sandbox.controller.request("GET", `/v1/sandboxes/${this.sandbox.id}/files`,
      { query: { path: file }, limit: MAX_FILE_BYTES });
  }

  async write(file, data, { mode = 0o644 } = {}) {
    await this.sandbox.controller.request("PUT", `/v1/sandboxes/${this.sandbox.id}/files`,
      { query: { path: file, mode: String(mode) }, raw: data });
  }
}

export class Sandbox {
  constructor(controller, id) {
    this.controller = controller;
    this.id = checkedId(id);
    this.commands = new Commands(this);
    this.files = new Files(this);
  }

  /** Fork one sandbox of `tag`; options: the fields of SpawnRequest, and `controller`. */
  static async create(tag, { controller, ...options } = {}) {
    const [sb] = await (controller ?? new Controller()).spawnSandboxes(tag, 1, options);
    return sb;
  }

  /** Attach to a running sandbox by id. */
  static connect(id, { controller } = {}) {
    return new Sandbox(controller ?? new Controller(), id);
  }

  get _route() { return `/v1/sandboxes/${this.id}`; }

  info() { return this.controller.json("GET", this._route); }

  /** Evaluate in the warm interpreter: the trailing expression's value (rejects on error). */
  async eval(code, { timeout = EVAL_TIMEOUT_S } = {}) {
    const r = await this.controller.json("POST", `${this._route}/eval`,
      { body: { code, timeout }, wait: answerTimeout(timeout) });
    if (r.error) throw new ForkdError(`${r.error.type}: ${r.error.message}`, { type: "EvalError" });
    return r.value;
  }

  /** A code-interpreter cell: results (PNG figures, HTML tables...), stdout, stderr, error. */
  runCode(code, { timeout = EVAL_TIMEOUT_S } = {}) {
    return this.controller.json("POST", `${this._route}/run_code`,
      { body: { code, timeout }, wait: answerTimeout(timeout) });
  }

  branch(tag, { force = false } = {}) {
    return this.controller.branchSandbox(this.id, tag, { force });
  }

  extend(seconds) { return this.controller.json("POST", `${this._route}/extend`, { body: { seconds } }); }
  pause() { return this.controller.json("POST", `${this._route}/pause`); }
  resume() { return this.controller.json("POST", `${this._route}/resume`); }
  async kill() { await this.controller.json("DELETE", this._route); }
}
