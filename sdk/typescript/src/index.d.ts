// Declarations of index.js. The request and answer types are api.d.ts, generated from
// forkd.controller.api: what the REST API takes and answers, field for field.

import type {
  BranchResult,
  EvalResult,
  ExecResult,
  LayerInfo,
  ProcessInfo,
  ProcessSignaled,
  ProcessWaitResult,
  RunCodeResult,
  SandboxInfo,
  SpawnRequest,
  StdinWritten,
} from "./api.js";

export * from "./api.js";

export declare const CONNECT_TIMEOUT_S: number;
export declare const REQUEST_TIMEOUT_S: number;
export declare const ANSWER_GRACE_S: number;
export declare const HEARTBEAT_S: number;
export declare const EVAL_TIMEOUT_S: number;
/** Bytes of one answer, one error answer, one streamed line this SDK reads at most. */
export declare const MAX_ANSWER_BYTES: number;
export declare const MAX_ERROR_BYTES: number;
export declare const MAX_FRAME_BYTES: number;
/** Bytes of a file files.read reads whole at most (a guest sends at most this of one file). */
export declare const MAX_FILE_BYTES: number;

export declare class ForkdError extends Error {
  constructor(message: string, options?: { type?: string; exitCode?: number; status?: number });
  type: string;
  exitCode: number;
  status: number;
}
export declare class InvalidInput extends ForkdError {}
export declare class NotFound extends ForkdError {}
export declare class Conflict extends ForkdError {}
export declare class IntegrityError extends ForkdError {}
export declare class SpawnError extends ForkdError {
  errors: string[];
}

export declare function defaultSocket(): string;

export type SpawnOptions = Omit<SpawnRequest, "tag" | "n">;
type Data = string | Uint8Array;

export interface ControllerOptions {
  /** http(s)://HOST:PORT of `forkd serve --listen`; without it, the Unix socket. */
  url?: string;
  /** The bearer token (TCP). */
  token?: string;
  /** The daemon's Unix socket (default: $FORKD_RUN/controller.sock). */
  socket?: string;
  /** Seconds to wait for requests that run no command (default REQUEST_TIMEOUT_S). */
  timeout?: number;
  /** Send the token over plain http:// to another host than this one (loopback); without
   * it such a URL is InvalidInput: anyone on the path could read the token. */
  plainHttp?: boolean;
}

export declare class Controller {
  constructor(options?: ControllerOptions);
  readonly where: string;
  snapshots(): Promise<LayerInfo[]>;
  sandboxes(): Promise<Sandbox[]>;
  spawnSandboxes(tag: string, n?: number, options?: SpawnOptions): Promise<Sandbox[]>;
  branchSandbox(sandboxId: string, tag: string, options?: { force?: boolean }): Promise<BranchResult>;
}

export interface RunOptions {
  env?: Record<string, string>;
  cwd?: string;
  stdin?: Data;
  /** Seconds; the command's process group is killed then. None: no deadline. */
  timeout?: number;
  onStdout?: (text: string) => void;
  onStderr?: (text: string) => void;
}

export declare class CommandHandle {
  readonly handle: string;
  readonly pid: number;
  readonly argv: string[];
  wait(options?: { timeout?: number | null }): Promise<ProcessWaitResult | null>;
  sendStdin(data: Data, options?: { close?: boolean }): Promise<StdinWritten>;
  closeStdin(): Promise<StdinWritten>;
  kill(signal?: number | string): Promise<ProcessSignaled>;
}

export declare class Commands {
  run(cmd: string | string[], options?: RunOptions & { background?: false }): Promise<ExecResult>;
  run(cmd: string | string[], options: RunOptions & { background: true }): Promise<CommandHandle>;
  start(
    cmd: string | string[],
    options?: { env?: Record<string, string>; cwd?: string; stdin?: Data; pty?: boolean },
  ): Promise<CommandHandle>;
  list(): Promise<ProcessInfo[]>;
}

export declare class Files {
  read(path: string): Promise<Buffer>;
  write(path: string, data: Data, options?: { mode?: number }): Promise<void>;
}

export declare class Sandbox {
  constructor(controller: Controller, id: string);
  static create(tag: string, options?: SpawnOptions & { controller?: Controller }): Promise<Sandbox>;
  static connect(id: string, options?: { controller?: Controller }): Sandbox;
  readonly id: string;
  readonly controller: Controller;
  readonly commands: Commands;
  readonly files: Files;
  info(): Promise<SandboxInfo>;
  eval(code: string, options?: { timeout?: number }): Promise<unknown>;
  runCode(code: string, options?: { timeout?: number | null }): Promise<RunCodeResult>;
  branch(tag: string, options?: { force?: boolean }): Promise<BranchResult>;
  extend(seconds: number): Promise<SandboxInfo>;
  pause(): Promise<SandboxInfo>;
  resume(): Promise<SandboxInfo>;
  kill(): Promise<void>;
}

export type { EvalResult };
