"""forkd guest agent (runs in the guest as PID 1; stdlib only, Python >= 3.9).

Serves protocol version 1 (docs/agent-protocol.md): JSON lines over the
virtio-serial port given as argv[1]. One request per line, one response per
line, matched by "id". On start it writes one unsolicited hello line.
"""

import ast
import base64
import contextlib
import fcntl
import io
import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

PROTOCOL = 1
MAX_LINE = 64 << 20
MAX_FILE = 32 << 20
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
# Safety net only: SIGIO wakes the idle agent when the host connects or sends.
IDLE_WAIT_S = 60.0

NS = {"__name__": "__forkd__", "__builtins__": __builtins__}


class ProtocolError(Exception):
    pass


# The request path runs in every forked child, and every Python function, object and code
# page it touches there is a copied-on-write page (and guest code QEMU translates) per child.
# So it stays short: JSON through the C scanner/encoder directly, not json.loads/dumps' Python
# layers (same output as json.dumps with the default separators and ensure_ascii).
_DECODER = json.JSONDecoder()


def _no_default(o: object) -> object:
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def _make_encoder() -> Callable[[Any], str]:
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is not None:
        try:
            enc = make(None, _no_default, json.encoder.encode_basestring_ascii, None,
                       ": ", ", ", False, False, True)
            return lambda o: "".join(enc(o, 0))
        except TypeError:  # another signature (other Python versions)
            pass
    return json.dumps


_ENCODE = _make_encoder()


def _line(obj: object) -> bytes:
    return (_ENCODE(obj) + "\n").encode()


def _reap() -> None:
    """PID 1 duty: collect orphaned processes (only between requests)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


PYTHON_VERSION = sys.version.split()[0]


def op_ping(req: dict[str, Any]) -> dict[str, Any]:
    # CLOCK_BOOTTIME is what /proc/uptime shows (no file objects on the request path: every
    # object a request touches costs a copied-on-write page in a forked child)
    up = round(time.clock_gettime(time.CLOCK_BOOTTIME), 2)
    return {"protocol": PROTOCOL, "uptime": up, "pid": os.getpid(),
            "python": PYTHON_VERSION, "hostname": socket.gethostname()}


def op_exec(req: dict[str, Any]) -> dict[str, Any]:
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ProtocolError("exec needs argv: a non-empty list of strings")
    env = dict(os.environ)
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("HOME", "/root")
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    stdin = req.get("stdin")
    data = None
    if stdin is not None:
        data = base64.b64decode(stdin) if req.get("stdin_b64") else str(stdin).encode()
    timeout = req.get("timeout")
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, input=data, capture_output=True, env=env,
                           cwd=req.get("cwd") or "/", timeout=timeout,
                           stdin=None if data is not None else subprocess.DEVNULL)
        out, err, code, timed_out = p.stdout, p.stderr, p.returncode, False
    except subprocess.TimeoutExpired as e:
        out, err, code, timed_out = e.stdout or b"", e.stderr or b"", -9, True
    except FileNotFoundError as e:
        out, err, code, timed_out = b"", str(e).encode(), 127, False
    except PermissionError as e:
        out, err, code, timed_out = b"", str(e).encode(), 126, False
    _reap()
    return {"exit_code": code, "stdout": out.decode("utf-8", "replace"),
            "stderr": err.decode("utf-8", "replace"), "timed_out": timed_out,
            "duration": time.monotonic() - t0}


def _jsonable(v: object) -> object:
    try:
        _ENCODE(v)  # no circular check: a circular value ends in RecursionError
        return v
    except (TypeError, ValueError, RecursionError):
        return None


def op_eval(req: dict[str, Any]) -> dict[str, Any]:
    code = req.get("code")
    if not isinstance(code, str):
        raise ProtocolError("eval needs code: a string of Python")
    out, err = io.StringIO(), io.StringIO()
    value = None
    error = None
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        try:
            expr = _compile_expr(code)
            value = eval(expr, NS) if expr is not None else _exec_repl(code)
        except BaseException as e:  # the caller's code may raise anything
            if isinstance(e, SystemExit):
                pass
            error = {"type": type(e).__name__, "message": str(e),
                     "traceback": traceback.format_exc()}
    finally:
        sys.stdout, sys.stderr = saved
    return {"value": _jsonable(value), "repr": None if value is None else repr(value),
            "stdout": out.getvalue(), "stderr": err.getvalue(), "error": error}


def _compile_expr(code: str) -> Any:
    """A single expression compiles directly, with no AST objects on the way; else None."""
    try:
        return compile(code, "<eval>", "eval")
    except (SyntaxError, ValueError):
        return None


def _exec_repl(code: str) -> object:
    """Run statements; the value of a trailing expression is returned, like a REPL."""
    tree = ast.parse(code, "<eval>", "exec")
    last = None
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr):
        tree.body.pop()
        last = ast.Expression(tail.value)
    exec(compile(tree, "<eval>", "exec"), NS)
    if last is not None:
        return eval(compile(last, "<eval>", "eval"), NS)
    return None


def op_put(req: dict[str, Any]) -> dict[str, Any]:
    path = req.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ProtocolError("put needs path: an absolute guest path")
    data = base64.b64decode(req.get("data", ""))
    if len(data) > MAX_FILE:
        raise ProtocolError("put: file larger than 32 MiB")
    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    tmp = path + ".forkd-tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, int(req.get("mode", 0o644)))
    os.replace(tmp, path)
    return {"bytes": len(data)}


def op_get(req: dict[str, Any]) -> dict[str, Any]:
    path = req.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ProtocolError("get needs path: an absolute guest path")
    size = os.path.getsize(path)
    if size > MAX_FILE:
        raise ProtocolError(f"get: {path} is {size} bytes, more than 32 MiB")
    with open(path, "rb") as f:
        data = f.read()
    return {"bytes": len(data), "data": base64.b64encode(data).decode()}


def op_fixup(req: dict[str, Any]) -> dict[str, Any]:
    """After a restore: clock, fresh entropy (kernel CRNG + Python/numpy PRNGs), hostname."""
    res: dict[str, Any] = {}
    if "time" in req:
        before = time.time()
        time.clock_settime(time.CLOCK_REALTIME, float(req["time"]))
        res["clock_skew"] = float(req["time"]) - before
    if "seed" in req:
        seed = bytes.fromhex(req["seed"])
        if len(seed) < 16:
            raise ProtocolError("fixup seed must be at least 16 bytes (32 hex digits)")
        fd = os.open("/dev/urandom", os.O_WRONLY)
        try:
            fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
            try:
                fcntl.ioctl(fd, RNDRESEEDCRNG)
                res["crng_reseeded"] = True
            except OSError as e:
                res["crng_reseeded"] = False
                res["reseed_error"] = str(e)
        finally:
            os.close(fd)
        random.seed(int.from_bytes(os.urandom(32), "little"))  # an int: no sha512 on the way
        reseeded = ["random"]
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed(int.from_bytes(os.urandom(4), "little"))
            reseeded.append("numpy")
        res["prng_reseeded"] = reseeded
    if "hostname" in req:
        name = str(req["hostname"])
        socket.sethostname(name)
        res["hostname"] = name
    net = req.get("net")
    if net:
        res["net"] = _net_fixup(net)
    return res


SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
SIOCSIFADDR, SIOCSIFNETMASK, SIOCSIFHWADDR, SIOCADDRT = 0x8916, 0x891C, 0x8924, 0x890B
IFF_UP, RTF_UP, RTF_GATEWAY, ARPHRD_ETHER = 0x1, 0x1, 0x2, 1


def _sockaddr_in(ip: str) -> bytes:
    return struct.pack("=H2s4s8x", socket.AF_INET, b"\0\0", socket.inet_aton(ip))


def _ifreq(name: str, payload: bytes) -> bytes:
    return struct.pack("16s", name.encode()) + payload.ljust(24, b"\0")


def _net_fixup(net: dict[str, Any]) -> dict[str, Any]:
    """A new network identity with plain ioctls (no iproute2 needed in the guest):
    {"ifname": "eth0", "mac": "02:..", "address": "10.200.1.7/16", "gateway": "10.200.0.1"}."""
    ifname = str(net.get("ifname", "eth0"))
    done = []
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if net.get("mac"):
            mac = bytes.fromhex(str(net["mac"]).replace(":", ""))
            fcntl.ioctl(s, SIOCSIFHWADDR, _ifreq(ifname, struct.pack("=H6s", ARPHRD_ETHER, mac)))
            done.append("mac")
        if net.get("address"):
            addr, _, plen = str(net["address"]).partition("/")
            bits = int(plen or 32)
            mask = socket.inet_ntoa(struct.pack("!I", (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF))
            fcntl.ioctl(s, SIOCSIFADDR, _ifreq(ifname, _sockaddr_in(addr)))
            fcntl.ioctl(s, SIOCSIFNETMASK, _ifreq(ifname, _sockaddr_in(mask)))
            done.append("address")
        flags = struct.unpack_from("=H", fcntl.ioctl(s, SIOCGIFFLAGS, _ifreq(ifname, b"")), 16)[0]
        if not flags & IFF_UP:
            fcntl.ioctl(s, SIOCSIFFLAGS, _ifreq(ifname, struct.pack("=H", flags | IFF_UP)))
        if net.get("gateway"):
            # struct rtentry (x86_64): default route via the gateway
            rt = struct.pack("=Q16s16s16sHh4xQQh6xQQQH6x", 0, _sockaddr_in("0.0.0.0"),
                             _sockaddr_in(str(net["gateway"])), _sockaddr_in("0.0.0.0"),
                             RTF_UP | RTF_GATEWAY, 0, 0, 0, 0, 0, 0, 0, 0)
            with contextlib.suppress(FileExistsError):
                fcntl.ioctl(s, SIOCADDRT, rt)
            done.append("gateway")
    finally:
        s.close()
    return {"changed": done}


def op_sync(req: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    os.sync()
    if req.get("drop_caches"):
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    return {"duration": time.monotonic() - t0}


OPS = {"ping": op_ping, "exec": op_exec, "eval": op_eval, "put": op_put, "get": op_get,
       "fixup": op_fixup, "sync": op_sync}


def handle(line: bytes) -> dict[str, Any]:
    rid = None
    try:
        req = _DECODER.decode(line.decode())
        if not isinstance(req, dict):
            raise ProtocolError("a request must be a JSON object")
        rid = req.get("id")
        if req.get("v", PROTOCOL) != PROTOCOL:
            raise ProtocolError(f"unsupported protocol version {req.get('v')!r}; "
                                f"this agent speaks {PROTOCOL}")
        op = OPS.get(str(req.get("op")))
        if op is None:
            raise ProtocolError(f"unknown op {req.get('op')!r}; known: {sorted(OPS)}")
        return {"id": rid, "ok": True, "result": op(req)}
    except ProtocolError as e:
        return {"id": rid, "ok": False, "error": {"type": "protocol", "message": str(e)}}
    except ValueError as e:
        return {"id": rid, "ok": False,
                "error": {"type": "protocol", "message": f"bad request: {e}"}}
    except Exception as e:
        return {"id": rid, "ok": False,
                "error": {"type": "guest", "message": f"{type(e).__name__}: {e}"}}


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            n = os.write(fd, data)
        except OSError:
            time.sleep(0.05)  # host side went away mid-reply; keep trying briefly
            continue
        data = data[n:]


def _port_events(fd: int) -> int:
    """A pipe that becomes readable when the port's state changes. With no host connected,
    read() on a virtio-serial port returns EOF at once and poll() reports POLLHUP, so neither
    can wait; but virtio_console raises SIGIO on an O_ASYNC port when the host connects or
    disconnects and when data arrives. The signal's wake-up fd is that pipe."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGIO, lambda signum, frame: None)
    fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    return r


def serve(port: str) -> None:
    fd = os.open(port, os.O_RDWR)
    events = _port_events(fd)
    hello = {"hello": {"protocol": PROTOCOL, "agent": "forkd-agent", **op_ping({})}}
    _write_all(fd, _line(hello))
    buf = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            # Host side not connected: read() returned EOF at once. Sleep until SIGIO (a
            # signal raised after the read() is still in the pipe), then drain the pipe
            # before reading again. No periodic wake-ups while idle.
            select.select([events], [], [], IDLE_WAIT_S)
            with contextlib.suppress(OSError):
                os.read(events, 4096)
            continue
        buf += chunk
        if len(buf) > MAX_LINE and b"\n" not in buf:
            buf = b""
            err = {"type": "protocol", "message": "request line longer than 64 MiB"}
            _write_all(fd, _line({"id": None, "ok": False, "error": err}))
            continue
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                _write_all(fd, _line(handle(line)))


def main() -> None:
    os.environ.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    os.environ.setdefault("HOME", "/root")
    with contextlib.suppress(OSError):
        socket.sethostname("forkd")
    with contextlib.suppress(OSError):
        subprocess.run(["ip", "link", "set", "lo", "up"], stderr=subprocess.DEVNULL, check=False)
    print(f"FORKD-AGENT protocol={PROTOCOL} port={sys.argv[1]}", flush=True)
    serve(sys.argv[1])


if __name__ == "__main__":
    main()
