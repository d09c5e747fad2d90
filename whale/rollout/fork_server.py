"""The fork server a rollout run plays its episodes in, launched before the run needs it.

Each run gets one sandboxed fork server (whale/rollout/sandbox_worker.py; docs/sandbox.md): the
interpreter starts under bubblewrap, receives the harness source, and forks one process per episode.
Starting that interpreter took 55-66 ms on an idle 2-core machine and up to 160 ms with the engine
working beside it, and until it is up no episode can make its first call: the engine sat idle for it
at the start of every run (0.24-0.28 s of a 4 s chess run, docs/performance.md). The interpreter
does not need the harness to start (the source arrives later, in its `init` message), so
`SpareForkServer` keeps one process launched ahead of time and the next run adopts it; a new spare is
launched as each run ends, while the caller does whatever comes next (grading, training, the next
candidate). A spare is only started early, never reused: every run still gets a fork server no
episode has touched.

`ForkServerProcess` is the launched process (no event loop needed); `SandboxHost` adopts one inside a
run's event loop, sends it the harness and spawns the episodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import threading

from whale.config import SandboxConfig
from whale.rollout.sandbox import (Cgroup, _extra_paths, _limits, resolve_mode, worker_command,
                                   world_readable_stdlib)


class ForkServerProcess:
    """A fork server process (bubblewrap or the fallback), launched and waiting for its harness."""

    def __init__(self, cfg: SandboxConfig, concurrency: int):
        self.mode = resolve_mode(cfg.mode)
        self.key = _launch_key(self.mode, cfg, concurrency)
        # bubblewrap's --die-with-parent ends the sandbox with the THREAD that launched it
        self.thread = threading.get_ident()
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv, env, cwd = worker_command(self.mode, cfg, ["--control-fd", str(child_sock.fileno())])
        slots = concurrency + 2
        self.cgroup = Cgroup.create(cfg.memory_mb * 1024 * 1024 * min(slots, 8), cfg.max_processes * slots + 8)
        try:
            self.proc = subprocess.Popen(  # no preexec_fn: Python vforks (Cgroup.command says why)
                self.cgroup.command(argv) if self.cgroup else argv, env=env, cwd=cwd, pass_fds=[child_sock.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            )
        except BaseException:
            parent_sock.close()
            if self.cgroup:
                self.cgroup.remove()
            raise
        finally:
            child_sock.close()
        self.sock = parent_sock

    def fits(self, cfg: SandboxConfig, concurrency: int) -> bool:
        """Whether a run with these settings, in this thread, can adopt this process: same sandbox
        settings and slots, still running, and launched by this thread (so it lives as long as the
        run's thread does)."""
        return (self.key == _launch_key(resolve_mode(cfg.mode), cfg, concurrency)
                and self.thread == threading.get_ident() and self.proc.poll() is None)

    def kill(self) -> None:
        """Kill the process group (the sandbox and every episode in it), reap it, drop its cgroup."""
        self.signal_kill()
        self.proc.wait()
        self.release()

    def signal_kill(self) -> None:
        """Close the control socket and SIGKILL the process group; returns at once."""
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            os.killpg(self.proc.pid, 9)
        except OSError:
            pass

    def release(self) -> None:
        """After the process was reaped: close its stderr pipe, remove its cgroup."""
        if self.proc.stderr:
            self.proc.stderr.close()
        if self.cgroup:
            self.cgroup.remove()
            self.cgroup = None


def _launch_key(mode: str, cfg: SandboxConfig, concurrency: int) -> tuple:
    """What a fork server was launched for: the resolved sandbox mode, the settings, the slots."""
    return mode, cfg.model_dump_json(), concurrency


class SpareForkServer:
    """At most one fork server launched ahead of the next run (module docstring). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spare: ForkServerProcess | None = None

    def take(self, cfg: SandboxConfig, concurrency: int) -> ForkServerProcess:
        """The spare if it fits this run, else a process launched now (an unfit spare is killed)."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            if spare.fits(cfg, concurrency):
                return spare
            spare.kill()
        return ForkServerProcess(cfg, concurrency)

    def launch(self, cfg: SandboxConfig, concurrency: int) -> None:
        """Launch the next run's fork server now (replacing a spare that does not fit)."""
        with self._lock:
            spare = self._spare
            if spare is not None and spare.fits(cfg, concurrency):
                return
            self._spare = None
        if spare is not None:
            spare.kill()
        try:
            process = ForkServerProcess(cfg, concurrency)
        except (OSError, RuntimeError):
            return  # the next run launches its own, and reports what fails there
        with self._lock:
            process, self._spare = self._spare, process
        if process is not None:  # another thread launched one meanwhile
            process.kill()

    def close(self) -> None:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.kill()


class SandboxHost:
    """One sandbox (one fork server) per harness candidate; spawns episodes in it.

    Async: used from the rollout runner's event loop. `spawn` returns the parent's end of the
    episode's socket as asyncio streams.
    """

    def __init__(self, source: str, cfg: SandboxConfig, concurrency: int, spare: SpareForkServer | None = None):
        self.source = source
        self.cfg = cfg
        self.mode = resolve_mode(cfg.mode)
        self.concurrency = concurrency
        self.spare = spare
        self.process: ForkServerProcess | None = None
        self.exits: dict[str, asyncio.Future] = {}
        self.spawned: dict[str, asyncio.Future] = {}
        self.init_error: str | None = None
        # without bubblewrap an unprivileged uid may not reach the stdlib (e.g. under /root)
        self.can_drop_privileges = self.mode == "bwrap" or world_readable_stdlib()
        self._ready: asyncio.Future | None = None

    async def start(self) -> None:
        """Adopt the spare fork server (or launch one), send it the harness, wait until it compiled."""
        loop = asyncio.get_running_loop()
        self.process = (self.spare.take(self.cfg, self.concurrency) if self.spare is not None
                        else ForkServerProcess(self.cfg, self.concurrency))
        self.sock = self.process.sock
        self.sock.setblocking(False)
        self._ready = loop.create_future()
        self._reader_task = asyncio.ensure_future(self._read_control())
        try:
            self._send({"op": "init", "source": self.source, "extra_paths": _extra_paths(self.mode, self.cfg)})
        except OSError:
            pass  # the process died before its init: the reader reports why (its stderr)
        try:
            await asyncio.wait_for(self._ready, timeout=60)
        except asyncio.TimeoutError:
            self.init_error = "sandbox did not start within 60 s"

    def _send(self, msg: dict, fds: list[int] | None = None) -> None:
        data = json.dumps(msg).encode() + b"\n"
        self.sock.setblocking(True)
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.sendall(data)
        finally:
            self.sock.setblocking(False)

    async def _read_control(self) -> None:
        loop = asyncio.get_running_loop()
        buf = b""
        while True:
            try:
                data = await loop.sock_recv(self.sock, 1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                op = msg.get("op")
                if op == "ready" and not self._ready.done():
                    self._ready.set_result(True)
                elif op == "init_error" and not self._ready.done():
                    self.init_error = msg.get("error", "harness failed to compile")
                    self._ready.set_result(False)
                elif op == "spawned":
                    fut = self.spawned.pop(msg["episode"], None)
                    if fut and not fut.done():
                        fut.set_result(msg["pid"])
                elif op == "exit":
                    fut = self.exits.get(msg["episode"])
                    if fut and not fut.done():
                        fut.set_result(msg["status"])
        # fork server gone: fail everything still waiting
        stderr = ""
        if self.process.proc.stderr:
            try:
                stderr = self.process.proc.stderr.read(2000).decode(errors="replace")
            except Exception:
                pass
        reason = f"sandbox exited: {stderr.strip()[-500:]}" if stderr.strip() else "sandbox exited"
        if not self._ready.done():
            self.init_error = reason
            self._ready.set_result(False)
        for fut in list(self.spawned.values()) + list(self.exits.values()):
            if not fut.done():
                fut.set_result(-1)

    async def spawn(self, episode: str, uid: int | None, seed: int, state: dict, tools: list[str]):
        loop = asyncio.get_running_loop()
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.exits[episode] = loop.create_future()
        self.spawned[episode] = loop.create_future()
        msg = {"op": "spawn", "episode": episode, "uid": uid, "seed": seed, "state": state,
               "tools": tools, "limits": _limits(self.cfg)}
        self._send(msg, [child_end.fileno()])
        child_end.close()
        await self.spawned[episode]
        reader, writer = await asyncio.open_unix_connection(sock=parent_end, limit=2 * 1024 * 1024)
        return reader, writer

    def kill(self, episode: str) -> None:
        try:
            self._send({"op": "kill", "episode": episode})
        except OSError:
            pass

    def exit_future(self, episode: str) -> asyncio.Future:
        return self.exits[episode]

    async def close(self) -> None:
        """Kill the sandbox and every episode in it; reap it and drop its cgroup."""
        if self.process is None:
            return
        self.process.signal_kill()
        await asyncio.get_running_loop().run_in_executor(None, self.process.proc.wait)
        self._reader_task.cancel()
        self.process.release()
