// The SDK against a real daemon: FORKD_URL + FORKD_TOKEN (TCP) and FORKD_SOCKET (the Unix
// socket) of a running `forkd serve`, FORKD_TAG a snapshot in its store. Run by
// tests/controller/test_typescript_sdk.py (which starts the daemon); skipped without them.

import assert from "node:assert/strict";
import { test } from "node:test";

import { Conflict, Controller, ForkdError, NotFound, Sandbox } from "../src/index.js";

const { FORKD_URL, FORKD_TOKEN, FORKD_SOCKET, FORKD_TAG } = process.env;
const skip = !(FORKD_URL && FORKD_TOKEN && FORKD_SOCKET && FORKD_TAG)
  && "needs FORKD_URL, FORKD_TOKEN, FORKD_SOCKET and FORKD_TAG of a running forkd serve";

const tcp = () => new Controller({ url: FORKD_URL, token: FORKD_TOKEN });

test("a wrong token is refused with the daemon's error", { skip }, async () => {
  const ctl = new Controller({ url: FORKD_URL, token: "wrong" });
  await assert.rejects(ctl.snapshots(), (e) => e instanceof ForkdError && e.status === 401);
});

test("commands, streaming, files, runCode, eval over TCP", { skip }, async () => {
  const sb = await Sandbox.create(FORKD_TAG, { controller: tcp(), timeout: 600 });
  try {
    const r = await sb.commands.run("echo hello; echo oops >&2; exit 3");
    assert.equal(r.exit_code, 3);
    assert.equal(r.status, "exited");
    assert.equal(r.stdout, "hello\n");
    assert.equal(r.stderr, "oops\n");
    assert.ok(r.duration > 0);

    // streamed: the command waits for a file the test writes once it saw the first line
    const seen = [];
    const streamed = await sb.commands.run(
      "echo ready; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo done",
      {
        timeout: 120,
        onStdout: (text) => {
          seen.push(text);
          if (text.includes("ready")) sb.files.write("/tmp/go", "");
        },
      },
    );
    assert.equal(streamed.status, "exited");
    assert.equal(seen.join(""), "ready\ndone\n");

    await sb.files.write("/tmp/data.bin", Buffer.from([0, 1, 2, 255]));
    assert.deepEqual([...(await sb.files.read("/tmp/data.bin"))], [0, 1, 2, 255]);
    await assert.rejects(sb.files.read("/tmp/none"), NotFound);

    assert.equal(await sb.eval("6 * 7"), 42);
    const cell = await sb.runCode("x = 2\nprint('side')\nx + 1");
    assert.equal(cell.stdout, "side\n");
    assert.equal(cell.value, 3);
    assert.equal(cell.results.find((res) => res.is_main_result).text, "3");
    const failed = await sb.runCode("1 / 0");
    assert.equal(failed.error.type, "ZeroDivisionError");

    const bg = await sb.commands.run("read line; echo got $line; sleep 30", { background: true });
    assert.ok((await sb.commands.list()).some((p) => p.handle === bg.handle));
    await bg.sendStdin("hi\n");
    assert.equal(await bg.wait({ timeout: 0.5 }), null); // still running
    await bg.kill();
    const ended = await bg.wait();
    assert.equal(ended.running, false);
    assert.equal(ended.status, "killed");
    await assert.rejects(bg.kill(), (e) => e instanceof NotFound || e instanceof Conflict);
  } finally {
    await sb.kill();
  }
  await assert.rejects(sb.info(), NotFound);
});

test("branch (with force) and the Unix socket", { skip }, async () => {
  const ctl = new Controller({ socket: FORKD_SOCKET });
  const sb = await Sandbox.create(FORKD_TAG, { controller: ctl });
  try {
    await sb.files.write("/root/note", "from node");
    const tag = `${FORKD_TAG.split(":")[0]}:node-branch`;
    const made = await sb.branch(tag);
    assert.equal(made.depth, 1);
    await assert.rejects(sb.branch(tag), Conflict);
    assert.ok((await sb.branch(tag, { force: true })).ref.startsWith(tag));
    const [child] = await ctl.spawnSandboxes(tag, 1);
    try {
      assert.equal((await child.files.read("/root/note")).toString(), "from node");
    } finally {
      await child.kill();
    }
    assert.ok((await ctl.snapshots()).some((s) => s.ref.startsWith(tag)));
  } finally {
    await sb.kill();
  }
  await assert.rejects(ctl.spawnSandboxes("no-such-tag:x", 1), NotFound);
});
