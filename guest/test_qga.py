#!/usr/bin/env python3
"""Tests `ferry-guest qga` (guest/qga.c) on the host, over a pty instead of a virtio-serial port.

    python3 guest/test_qga.py /path/to/ferry-guest

Each request must get exactly one response line that parses as JSON (libvirt drops its agent
connection on a line that does not), so a stray or missing line fails the checks that follow.
Exits 1 if any check fails.
"""
import base64
import json
import os
import select
import subprocess
import sys
import time
import tty

TIMEOUT = 5.0


class Agent:
    def __init__(self, binary):
        self.master, self.slave = os.openpty()
        tty.setraw(self.slave)
        self.path = os.ttyname(self.slave)
        self.proc = subprocess.Popen(
            [binary, "qga", self.path], stderr=subprocess.PIPE, env={}  # no PATH, as in /init
        )
        line = self.proc.stderr.readline().decode()
        if "serving on" not in line:
            raise RuntimeError(f"ferry-guest qga did not start: {line!r}")
        self.buf = b""

    def close(self):
        self.proc.kill()
        self.proc.wait()
        os.close(self.master)
        os.close(self.slave)

    def send(self, data):
        if isinstance(data, str):
            data = data.encode()
        while data:
            n = os.write(self.master, data)
            data = data[n:]

    def read_bytes(self, n):
        deadline = time.monotonic() + TIMEOUT
        while len(self.buf) < n:
            self._fill(deadline)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_line(self):
        deadline = time.monotonic() + TIMEOUT
        while b"\n" not in self.buf:
            self._fill(deadline)
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def _fill(self, deadline):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.master], [], [], left)[0]:
            raise TimeoutError(f"no response line (have {self.buf[:200]!r})")
        self.buf += os.read(self.master, 65536)

    def call(self, req):
        """Sends one request (a dict, or raw text) and returns the parsed response line."""
        self.send((json.dumps(req) if isinstance(req, dict) else req) + "\n")
        line = self.read_line()
        return json.loads(line)

    def quiet(self, wait=0.3):
        """True if nothing more arrives within `wait` seconds."""
        if self.buf:
            return False
        return not select.select([self.master], [], [], wait)[0]


failures = []


def check(name, cond, detail=""):
    print(("PASS " if cond else "FAIL ") + name + ("" if cond else f": {detail}"))
    if not cond:
        failures.append(name)


def exec_wait(a, args):
    """guest-exec, then guest-exec-status until it exits; returns the last status."""
    r = a.call({"execute": "guest-exec", "arguments": args})
    if "return" not in r:
        return r
    pid = r["return"]["pid"]
    deadline = time.monotonic() + TIMEOUT
    while True:
        s = a.call({"execute": "guest-exec-status", "arguments": {"pid": pid}})
        if "error" in s or s["return"]["exited"] or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def run(a):
    # libvirt's handshake, byte for byte (src/qemu/qemu_agent.c): an id of milliseconds.
    a.send('{"execute":"guest-sync", "arguments":{"id":1733912345678}}\n')
    line = a.read_line()
    check("guest-sync as libvirt sends it", line == b'{"return": 1733912345678}', line)

    for big in ("9007199254740993", "9223372036854775807", "-42"):
        a.send('{"execute":"guest-sync","arguments":{"id":%s}}\n' % big)
        line = a.read_line()
        check(f"guest-sync echoes {big} exactly", line == b'{"return": %s}' % big.encode(), line)

    r = a.call('{"execute":"guest-sync","arguments":{"id":1.5}}')
    check("guest-sync rejects a non-integer id", r.get("error", {}).get("class") == "GenericError", r)

    a.send(b'\xff{"execute":"guest-sync-delimited","arguments":{"id":123456789012}}\n')
    first = a.read_bytes(1)
    line = a.read_line()
    check("guest-sync-delimited: 0xFF first", first == b"\xff", first)
    check("guest-sync-delimited: then the id", line == b'{"return": 123456789012}', line)

    a.send(b'{"execute":"guest-ping", "argu\xff{"execute":"guest-sync","arguments":{"id":77}}\n')
    r = json.loads(a.read_line())
    check("0xFF drops a partial request", r == {"return": 77}, r)

    a.send(b'garbage\xff{"a": "unterminated [[\xff\n{"execute":"guest-sync","arguments":{"id":78}}\n')
    r = json.loads(a.read_line())
    check("0xFF drops garbage without a reply", r == {"return": 78}, r)

    r = a.call({"execute": "guest-ping"})
    check("guest-ping", r == {"return": {}}, r)

    r = a.call({"execute": "guest-ping", "id": {"a": [1, "x\ny"], "b": None}})
    check("id echoed", r == {"return": {}, "id": {"a": [1, "x\ny"], "b": None}}, r)

    r = a.call({"execute": "guest-info"})
    names = [c["name"] for c in r.get("return", {}).get("supported_commands", [])]
    check(
        "guest-info",
        r.get("return", {}).get("version") == "ferry-guest"
        and {"guest-sync", "guest-ping", "guest-exec", "guest-exec-status"} <= set(names),
        r,
    )

    s = exec_wait(a, {"path": "/bin/sh", "arg": ["-c", "exit 3"]})
    check("guest-exec sh -c 'exit 3' -> exitcode 3", s == {"return": {"exited": True, "exitcode": 3}}, s)

    r = a.call({"execute": "guest-exec", "arguments": {"path": "sleep", "arg": ["1"]}})
    pid = r.get("return", {}).get("pid")
    s = a.call({"execute": "guest-exec-status", "arguments": {"pid": pid}})
    check("guest-exec via PATH, running: exited false", s == {"return": {"exited": False}}, (r, s))
    time.sleep(1.2)
    s = a.call({"execute": "guest-exec-status", "arguments": {"pid": pid}})
    check("then exited, exitcode 0", s == {"return": {"exited": True, "exitcode": 0}}, s)
    s = a.call({"execute": "guest-exec-status", "arguments": {"pid": pid}})
    check("then forgotten, as qga does", s.get("error", {}).get("class") == "GenericError", s)

    s = exec_wait(a, {"path": "/bin/sh", "arg": ["-c", "kill -9 $$"]})
    check("killed by a signal -> signal 9", s == {"return": {"exited": True, "signal": 9}}, s)

    s = exec_wait(
        a,
        {
            "path": "/bin/sh",
            "arg": ["-c", "echo out; echo err >&2; exit 1"],
            "capture-output": True,
        },
    )
    ret = s.get("return", {})
    check(
        "capture-output",
        ret.get("exitcode") == 1
        and base64.b64decode(ret.get("out-data", "")) == b"out\n"
        and base64.b64decode(ret.get("err-data", "")) == b"err\n"
        and ret.get("out-truncated") is False,
        s,
    )

    tricky = 'q"uote b\\ackslash\ttab\nnl /slash \u00e9 \U0001f600 \\"'
    req = json.dumps(
        {
            "execute": "guest-exec",
            "arguments": {
                "path": "/bin/sh",
                "arg": ["-c", 'printf %s "$1"', "sh", tricky],
                "capture-output": True,
            },
        },
        ensure_ascii=True,  # \u00e9 and a surrogate pair, as virJSON may write them
    )
    r = a.call(req)
    pid = r.get("return", {}).get("pid")
    s = {}
    for _ in range(100):
        s = a.call({"execute": "guest-exec-status", "arguments": {"pid": pid}})
        if "error" in s or s["return"]["exited"]:
            break
        time.sleep(0.05)
    out = base64.b64decode(s.get("return", {}).get("out-data", ""))
    check("string escapes decoded", out == tricky.encode(), (out, s))

    s = exec_wait(
        a, {"path": "/bin/sh", "arg": ["-c", 'printf %s "$FOO"'], "env": ["FOO=bar"],
            "capture-output": True},
    )
    out = base64.b64decode(s.get("return", {}).get("out-data", ""))
    check("env", out == b"bar", s)

    r = a.call({"execute": "guest-exec", "arguments": {"path": "/nonexistent/ferry"}})
    check(
        "guest-exec of a missing program -> error",
        r.get("error", {}).get("class") == "GenericError"
        and "Failed to execute" in r["error"]["desc"],
        r,
    )

    r = a.call({"execute": "guest-exec", "arguments": {"path": "/bin/true", "arg": ["x"] * 65}})
    check("more than 64 args -> error", r.get("error", {}).get("class") == "GenericError", r)

    r = a.call({"execute": "guest-exec", "arguments": {"path": "/bin/true", "arg": "x"}})
    check("arg not an array -> error", r.get("error", {}).get("class") == "GenericError", r)

    r = a.call({"execute": "guest-exec-status", "arguments": {"pid": 999999999}})
    check(
        "guest-exec-status of an unknown pid -> error",
        r.get("error", {}).get("class") == "GenericError",
        r,
    )

    r = a.call({"execute": "guest-exec-status", "arguments": {}})
    check("guest-exec-status without pid -> error", "error" in r, r)

    r = a.call({"execute": "guest-frobnicate", "id": 7})
    check(
        "unknown command -> CommandNotFound",
        r.get("error", {}).get("class") == "CommandNotFound" and r.get("id") == 7,
        r,
    )

    for bad in ('{"execute": guest-ping}', '{"execute":"guest-ping",}', '{"execute":"guest-ping"]',
                '[1, 2]', '{"arguments": {}}', '{"execute": 5}',
                '{"execute":"guest-ping","arguments":[]}', '{"execute":"a\\x"}'):
        r = a.call(bad)
        check(f"malformed {bad!r} -> GenericError",
              r.get("error", {}).get("class") == "GenericError", r)

    r = a.call("hello")
    check("junk outside a request -> one error", r.get("error", {}).get("class") == "GenericError", r)

    a.send('{"execute":"guest-ping"}{"execute":"guest-sync","arguments":{"id":5}}')
    r1, r2 = json.loads(a.read_line()), json.loads(a.read_line())
    check("requests without newlines", (r1, r2) == ({"return": {}}, {"return": 5}), (r1, r2))

    big = json.dumps({"execute": "guest-ping", "arguments": {"x": "A" * 70000}})
    r = a.call(big)
    check("over-long request -> error", r.get("error", {}).get("class") == "GenericError", r)
    r = a.call({"execute": "guest-ping"})
    check("and the next request works", r == {"return": {}}, r)

    r = a.call("[" * 40 + "]" * 40)
    check("deep nesting -> error", r.get("error", {}).get("class") == "GenericError", r)
    r = a.call({"execute": "guest-ping"})
    check("and the next request works", r == {"return": {}}, r)

    check("no stray output", a.quiet(), a.buf)


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    a = Agent(sys.argv[1])
    try:
        run(a)
    except Exception as e:  # a timeout or an unparsable line: report it as a failure
        check("protocol", False, repr(e))
    finally:
        a.close()
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
