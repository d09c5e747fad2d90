"""The sandbox side of the harness runner: a fork server plus the `env`/`llm` proxies.

This file runs *inside* the sandbox with `python -I -S -B` and imports the standard library only:
the sandbox shows it nothing else (not the `whale` package, not site-packages). It is a standalone
script on purpose; do not import it from the product.

Protocol (JSON lines):
- control socket (fd given by --control-fd), parent -> fork server:
  {"op": "init", "source": str, "extra_paths": [...]}            -> {"op": "ready"} | {"op": "init_error"}
  {"op": "spawn", "episode": id, "uid": int|null, "seed": int, "state": {...},
   "tools": [...], "limits": {...}}  + one fd (the episode socket) -> {"op": "spawned", "episode", "pid"}
  {"op": "kill", "episode": id}                                   -> (kills every process of that episode)
  fork server -> parent, unprompted: {"op": "exit", "episode": id, "status": int}
- episode socket, harness process <-> parent:
  child: {"id": n, "op": "llm", "args": {...}} | {"id": n, "op": "tool", "name", "args", "kwargs"}
         | {"id": n, "op": "mark", "call": k, "used": bool, "text": str}  (k-th completion returned)
         | {"op": "done", "error": str|null, "stdout": str}
  parent: {"id": n, "ok": value, "state": {...}} | {"id": n, "error": str, "fatal": bool}

Why a fork server: starting a fresh interpreter under bubblewrap costs ~50-100 ms; forking a warm
one costs ~1 ms and still gives every episode fresh module state, because the harness module is
executed in the child after the fork.

Why episodes drop to their own uid: rlimits (processes, memory) do not bind root, and developers
and CI run as root. Each episode runs as an unprivileged uid that no other live episode has, so
RLIMIT_NPROC caps that episode alone and it cannot signal or ptrace anything else.
"""

import ctypes
import io
import json
import os
import random
import resource
import signal
import socket
import sys
import traceback
import types

# Preload modules harnesses commonly use, so episodes pay no import cost (and, in the no-bubblewrap
# fallback, can import them after dropping privileges even where the stdlib is not world-readable).
PRELOAD = (
    "re json math random string textwrap collections itertools functools heapq bisect "
    "statistics fractions decimal dataclasses typing enum copy difflib unicodedata html operator"
)
for _name in PRELOAD.split():
    try:
        __import__(_name)
    except Exception:
        pass


class SandboxError(Exception):
    """Raised inside the harness when the parent refuses a request (bad args, budget, tool error)."""


class BudgetExceeded(SandboxError):
    pass


class Completion(str):
    """Model output: a `str`, plus .finish_reason, .tool_calls and .usage.

    `use()` / `discard()` tell the parent to train on this completion (if the episode is accepted)
    or not, overriding its default rule (trained only when the text reached an action, the answer
    or a later used call). Call them on the object `llm` returned: `str` methods return plain strings.
    """

    def __new__(cls, text, finish_reason="stop", tool_calls=None, usage=None, mark=None):
        obj = super().__new__(cls, text)
        obj.finish_reason = finish_reason
        obj.tool_calls = tool_calls
        obj.usage = usage or {}
        obj._mark = mark
        return obj

    def use(self):
        self._send_mark(True)

    def discard(self):
        self._send_mark(False)

    def _send_mark(self, used):
        if self._mark is None:
            raise SandboxError("only a completion returned by llm() can be marked")
        self._mark(used)


class _TailBuffer(io.TextIOBase):
    """stdout/stderr replacement: keeps only the last few KB (a harness may print gigabytes)."""

    def __init__(self, limit=4000):
        self.limit = limit
        self.buf = ""

    def write(self, s):
        s = str(s)
        self.buf = (self.buf + s)[-self.limit :]
        return len(s)

    def writable(self):
        return True


class _Channel:
    def __init__(self, sock):
        self.sock = sock
        self.rfile = sock.makefile("rb")
        self.next_id = 0

    def send(self, msg):
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def request(self, msg):
        self.next_id += 1
        msg["id"] = self.next_id
        self.send(msg)
        line = self.rfile.readline()
        if not line:
            os._exit(3)  # parent went away or killed the episode
        reply = json.loads(line)
        if "error" in reply:
            if reply.get("fatal"):
                raise BudgetExceeded(reply["error"])
            raise SandboxError(reply["error"])
        return reply


class _Env:
    """`env` proxy: tool methods and read-only state attributes forwarded to the parent."""

    def __init__(self, channel, tools, state):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_tools", tuple(tools))
        object.__setattr__(self, "_state", dict(state))

    def __getattr__(self, name):
        state = object.__getattribute__(self, "_state")
        if name in state:
            return state[name]
        if name in object.__getattribute__(self, "_tools"):
            def tool(*args, **kwargs):
                reply = self._channel.request({"op": "tool", "name": name, "args": list(args), "kwargs": kwargs})
                if isinstance(reply.get("state"), dict):
                    object.__setattr__(self, "_state", reply["state"])
                return reply.get("ok")
            tool.__name__ = name
            return tool
        raise AttributeError(f"env has no attribute {name!r}; tools: {list(self._tools)}, state: {list(state)}")

    def __setattr__(self, name, value):
        raise AttributeError("env is read-only; use its tools")

    def __dir__(self):
        return sorted(set(self._tools) | set(self._state))


def _make_llm(channel):
    returned = [0]  # completions handed to the harness so far: the parent counts the same way

    def marker(ordinal, text):
        def mark(used):
            channel.request({"op": "mark", "call": ordinal, "used": bool(used), "text": text})
        return mark

    def llm(messages, *, max_tokens=None, stop=None, choices=None, n=1, tools=None, template_kwargs=None):
        args = {"messages": messages, "max_tokens": max_tokens, "stop": stop, "choices": choices, "n": n,
                "tools": tools, "template_kwargs": template_kwargs}
        reply = channel.request({"op": "llm", "args": args})
        outs = []
        for o in reply["ok"]:
            outs.append(Completion(o["text"], o.get("finish_reason", "stop"), o.get("tool_calls"), o.get("usage"),
                                   marker(returned[0], o["text"])))
            returned[0] += 1
        return outs if n > 1 else outs[0]

    return llm


def _set_limits(limits):
    mem = int(limits.get("memory_mb", 1024)) * 1024 * 1024
    for res, value in (
        (resource.RLIMIT_AS, mem),
        (resource.RLIMIT_CPU, int(limits.get("cpu_seconds", 120))),
        (resource.RLIMIT_FSIZE, int(limits.get("file_bytes", 16 * 1024 * 1024))),
        (resource.RLIMIT_NPROC, int(limits.get("max_processes", 16))),
        (resource.RLIMIT_NOFILE, 256),
        (resource.RLIMIT_CORE, 0),
    ):
        try:
            resource.setrlimit(res, (value, value))
        except (ValueError, OSError):
            pass


def _drop_privileges(uid):
    if uid is None or os.getuid() != 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    except Exception:
        pass
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() == 0:
        os._exit(4)


def _episode(code, sock, spec):
    """Runs in the forked child: limits, privilege drop, then the harness. Never returns."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _set_limits(spec.get("limits", {}))
    _drop_privileges(spec.get("uid"))
    out = _TailBuffer()
    sys.stdout = sys.stderr = out
    channel = _Channel(sock)
    error = None
    try:
        random.seed(spec.get("seed", 0))
        module = types.ModuleType("harness")
        module.__file__ = "harness.py"
        sys.modules["harness"] = module
        exec(code, module.__dict__)
        run = module.__dict__.get("run")
        if not callable(run):
            raise SandboxError("harness defines no callable run(env, llm)")
        run(_Env(channel, spec.get("tools", []), spec.get("state", {})), _make_llm(channel))
    except BaseException as exc:  # noqa: BLE001 - everything the harness does is reported, not raised
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        error = "".join(ln for ln in lines if __file__ not in ln and "worker.py" not in ln)[-3000:]
    try:
        channel.send({"op": "done", "error": error, "stdout": out.buf})
    except Exception:
        pass
    os._exit(0)


def _kill_uid(uid, pgid):
    """Kill every process owned by an episode's uid (grandchildren that escaped its group too)."""
    if pgid:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    if uid is None:
        return
    for _ in range(3):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                os.kill(int(pid), signal.SIGKILL)
                                found = True
                            break
            except (OSError, ValueError):
                continue
        if not found:
            return


def fork_server(control_fd):
    control = socket.socket(fileno=control_fd)
    rfile_buf = b""
    pending_fds = []  # fds arrive with the chunk that holds the start of their spawn line
    code = None
    episodes = {}  # episode id -> (pid, uid)
    pid_to_episode = {}

    def send(msg):
        control.sendall(json.dumps(msg).encode() + b"\n")

    def reap():
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ep = pid_to_episode.pop(pid, None)
            if ep is not None:
                send({"op": "exit", "episode": ep, "status": status})

    control.settimeout(0.2)
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(control, 1 << 20, 4)
        except socket.timeout:
            reap()
            continue
        if not data:
            break  # parent closed: exit, the sandbox dies with us
        rfile_buf += data
        pending_fds.extend(fds)
        while b"\n" in rfile_buf:
            line, rfile_buf = rfile_buf.split(b"\n", 1)
            msg = json.loads(line)
            op = msg.get("op")
            if op == "init":
                for p in msg.get("extra_paths", []):
                    sys.path.append(p)
                try:
                    code = compile(msg["source"], "harness.py", "exec")
                    send({"op": "ready"})
                except BaseException as exc:  # noqa: BLE001
                    send({"op": "init_error", "error": f"{type(exc).__name__}: {exc}"})
            elif op == "spawn":
                fd = pending_fds.pop(0)
                pid = os.fork()
                if pid == 0:
                    control.close()
                    _episode(code, socket.socket(fileno=fd), msg)
                os.close(fd)
                episodes[msg["episode"]] = (pid, msg.get("uid"))
                pid_to_episode[pid] = msg["episode"]
                send({"op": "spawned", "episode": msg["episode"], "pid": pid})
            elif op == "kill":
                pid, uid = episodes.pop(msg["episode"], (None, None))
                if pid is not None:
                    _kill_uid(uid, pid)
        reap()


def snippet(limits_json, uid):
    """One-shot mode for tools such as math's env.python: run code from stdin, print to stdout."""
    spec = json.loads(limits_json)
    code = sys.stdin.read()
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader (started with start_new_session)
    _set_limits(spec)
    _drop_privileges(None if uid == "none" else int(uid))
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, "<tool>", "exec"), namespace)
    except SystemExit:
        pass
    except BaseException:  # noqa: BLE001
        traceback.print_exc(limit=2)
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "--control-fd":
        fork_server(int(sys.argv[2]))
    elif sys.argv[1] == "--snippet":
        snippet(sys.argv[2], sys.argv[3])
