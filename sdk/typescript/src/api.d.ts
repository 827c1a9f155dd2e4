// The controller API's types, generated from forkd.controller.api (through the OpenAPI
// document) by forkd.controller.app.typescript_types: do not edit. Regenerate with
//   python3 -P -c 'from forkd.controller.app import typescript_types as t; print(t(), end="")' \
//     > sdk/typescript/src/api.d.ts

export interface BranchRequest {
  tag: string;
  force?: boolean;
}

export interface BranchResult {
  ref: string;
  digest: string;
  parent: string;
  mode: string;
  pause_ms: number;
  pause_pages: number;
  copy_ms: number;
  rounds: number;
  forced: boolean;
  scan_ms: number;
  read_ms: number;
  devstate_ms: number;
  diff_pages: number;
  diff_bytes: number;
  stored_bytes: number;
  store_ms: number;
  depth: number;
  compacted: boolean;
}

export interface CodeResult {
  text: string;
  is_main_result?: boolean;
  png?: string | null;
  jpeg?: string | null;
  html?: string | null;
  markdown?: string | null;
  svg?: string | null;
  latex?: string | null;
  json?: unknown;
}

export interface CompactRequest {
  ref: string;
  to: string;
}

export interface ErrorAnswer {
  error: ErrorBody;
}

export interface ErrorBody {
  type: string;
  message: string;
  exit_code: number;
}

export interface EvalError {
  type: string;
  message: string;
  traceback?: string;
}

export interface EvalRequest {
  code: string;
  timeout?: number;
}

export interface EvalResult {
  value?: unknown;
  repr?: string | null;
  stdout?: string;
  stderr?: string;
  error?: EvalError | null;
}

export interface ExecFrame {
  stdout?: string | null;
  stderr?: string | null;
  result?: ExecResult | null;
  error?: ErrorBody | null;
}

export interface ExecRequest {
  argv: string[];
  env?: Record<string, string> | null;
  cwd?: string | null;
  stdin_b64?: string | null;
  timeout?: number | null;
}

export interface ExecResult {
  status: "exited" | "signaled" | "killed" | "timed_out" | "oom_killed";
  exit_code: number;
  signal?: number | null;
  timed_out?: boolean;
  killed?: boolean;
  oom_killed?: boolean;
  duration?: number;
  stdout?: string;
  stderr?: string;
  pid?: number | null;
}

export interface ExtendRequest {
  seconds: number;
}

export interface Health {
  status: string;
  version: string;
}

export interface LayerInfo {
  ref: string;
  digest: string;
  depth: number;
  memory_size: number;
  stored_bytes: number;
  new_pages: number;
  compacted: boolean;
}

export interface PoolRemoved {
  tag: string;
  removed: boolean;
}

export interface PoolRequest {
  tag: string;
  k: number;
  memory_limit_mib?: number | null;
  netns?: boolean;
  sandbox?: boolean;
  wait?: boolean;
}

export interface PoolStatus {
  tag: string;
  target: number;
  waiting: number;
  starting: number;
  digest: string | null;
  memory_limit_mib: number | null;
  limits: Record<string, unknown>;
  sandbox: boolean;
  netns: boolean;
  taken: number;
  last_error: string | null;
}

export interface ProcessInfo {
  handle: string;
  pid: number;
  argv: string[];
  pty?: boolean;
  status?: string | null;
  running?: boolean;
  exit_code?: number | null;
  started_s_ago?: number;
}

export interface ProcessKillRequest {
  signal?: number | string;
}

export interface ProcessSignaled {
  handle: string;
  signal: number;
}

export interface ProcessStartRequest {
  argv: string[];
  env?: Record<string, string> | null;
  cwd?: string | null;
  stdin_b64?: string | null;
  pty?: boolean;
}

export interface ProcessStdinRequest {
  data_b64?: string | null;
  close?: boolean;
}

export interface ProcessWaitRequest {
  timeout?: number | null;
}

export interface ProcessWaitResult {
  handle: string;
  running: boolean;
  status?: string | null;
  exit_code?: number | null;
  signal?: number | null;
  timed_out?: boolean;
  killed?: boolean;
  oom_killed?: boolean;
  duration?: number | null;
  stdout?: string;
  stderr?: string;
}

export interface Removed {
  removed: string[];
}

export interface RunCodeRequest {
  code: string;
  timeout?: number | null;
}

export interface RunCodeResult {
  results?: CodeResult[];
  stdout?: string;
  stderr?: string;
  error?: EvalError | null;
  value?: unknown;
  repr?: string | null;
}

export interface SandboxInfo {
  id: string;
  ref: string;
  digest: string;
  pid: number;
  dir: string;
  memory: string;
  disk_backing: string;
  memory_mib: number;
  created: number;
  cgroup?: string | null;
  cgroup_version?: string | null;
  cgroups?: Record<string, string>;
  netns?: string | null;
  mac?: string | null;
  ip?: string | null;
  limits?: Record<string, unknown>;
  sandbox?: boolean;
  deadline?: number | null;
  timeout_s?: number | null;
  on_timeout?: string;
  paused_tag?: string | null;
  origin?: string | null;
  timings_ms?: Record<string, number>;
  status?: string;
  egress?: Record<string, unknown>;
  proxy_pid?: number | null;
  time_left_s?: number | null;
}

export interface SpawnRequest {
  tag: string;
  n?: number;
  memory_limit_mib?: number | null;
  netns?: boolean;
  sandbox?: boolean;
  prewarm?: number | null;
  timeout?: number | null;
  on_timeout?: "kill" | "pause";
  cpus?: number | null;
  pids_max?: number | null;
  disk_bps?: number | null;
  disk_iops?: number | null;
  net_kbit?: number | null;
  egress?: string[] | null;
  lazy?: boolean;
}

export interface SpawnResult {
  sandboxes: SandboxInfo[];
  assemble_ms: number;
  total_ms: number;
  errors: string[];
}

export interface StdinWritten {
  bytes: number;
  closed: boolean;
}
