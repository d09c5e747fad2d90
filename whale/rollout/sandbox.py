"""Where harness code runs: a bubblewrap sandbox (or a weaker fallback), its limits, one-shot tool code.

Layers, strongest first (docs/sandbox.md says exactly what each guarantees):
1. bubblewrap (`mode: bwrap`, the default when `bwrap` works): new network, PID, IPC and UTS
   namespaces; a read-only file system that holds only the interpreter, its standard library
   (site-packages hidden by an empty tmpfs), system libraries under /usr, an allowlist of
   third-party packages and the worker script; a private /tmp; a cleared environment.
2. cgroups (v1 or v2, when writable): one per sandbox, capping memory and process count of all its
   episodes together, so a fork or memory bomb cannot take the machine.
3. inside, each episode forks from the fork server, drops to a uid of its own (when we are root),
   sets no_new_privs and rlimits (address space, CPU seconds, file size, processes, open files).
Without bubblewrap (`mode: process`) only 2-3 hold: the harness can read what the uid it runs as
may read and can open network connections. A one-line warning says so.

The fork server a rollout run plays its episodes in is launched and driven by
whale/rollout/fork_server.py, with the command lines and cgroups made here.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path

from whale.config import SandboxConfig

WORKER = Path(__file__).with_name("sandbox_worker.py")
SANDBOX_WORKER_PATH = "/opt/whale/worker.py"
SANDBOX_SITE = "/opt/whale/site"
UID_BASE = 61000
UID_COUNT = 2000


# ---------------------------------------------------------------- uids, one per live episode
class _UidPool:
    def __init__(self):
        self.lock = threading.Lock()
        self.free = list(range(UID_BASE, UID_BASE + UID_COUNT))

    def take(self) -> int | None:
        if os.getuid() != 0:
            return None  # unprivileged already: rlimits bind, nothing to drop to
        with self.lock:
            return self.free.pop(0) if self.free else None

    def give(self, uid: int | None) -> None:
        if uid is not None:
            with self.lock:
                self.free.append(uid)

    def use_range(self, start: int, stop: int) -> None:
        """Hand out only uids in [start, stop): processes sharing a node take disjoint ranges,
        so two of them never drop concurrent episodes to the same uid."""
        if stop - start < 1:
            raise ValueError(f"empty uid range [{start}, {stop})")
        with self.lock:
            self.free = list(range(start, stop))


UIDS = _UidPool()


# ---------------------------------------------------------------- cgroups
class Cgroup:
    """A cgroup (v1 memory+pids, or v2) for one sandbox; `None` from `create` when not writable."""

    _counter = itertools.count()

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    @classmethod
    def create(cls, memory_bytes: int, pids_max: int) -> "Cgroup | None":
        name = f"whale-{os.getpid()}-{next(cls._counter)}"
        v1 = [Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/pids")]
        v2 = Path("/sys/fs/cgroup")
        try:
            if all((d / "cgroup.procs").exists() for d in v1):
                dirs = [d / name for d in v1]
                for d in dirs:
                    d.mkdir()
                (dirs[0] / "memory.limit_in_bytes").write_text(str(memory_bytes))
                (dirs[1] / "pids.max").write_text(str(pids_max))
                return cls(dirs)
            if (v2 / "cgroup.subtree_control").exists():
                controllers = (v2 / "cgroup.subtree_control").read_text().split()
                if "memory" in controllers and "pids" in controllers:
                    d = v2 / name
                    d.mkdir()
                    (d / "memory.max").write_text(str(memory_bytes))
                    (d / "pids.max").write_text(str(pids_max))
                    return cls([d])
        except OSError:
            return None
        return None

    def command(self, argv: list[str]) -> list[str]:
        """`argv` started inside this cgroup: /bin/sh writes its own pid into every controller's
        `cgroup.procs`, then execs `argv` (same pid), so nothing runs outside the cgroup.

        Why not `preexec_fn`: with one, subprocess must fork() the whole parent, and forking the
        engine's multi-GB process took ~100 ms (its page tables, on the 2-core AMX Xeon at 4.2 GiB)
        while the engine thread's page faults waited on it; without one Python uses vfork (0.1 ms).
        Every fork server and every sandboxed tool call (math's `env.python`) starts this way."""
        joins = " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in self.dirs)
        program = argv[0] if os.path.isabs(argv[0]) else (shutil.which(argv[0]) or argv[0])
        return ["/bin/sh", "-c", f'{joins} && exec "$@"', "sh", program, *argv[1:]]

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone. A killed sandbox's processes take a few
        milliseconds to exit, so the retries start at 1 ms: a fixed 20 ms pause cost every rollout
        run and every sandboxed tool call (math's `env.python`) 20 ms of waiting."""
        for d in self.dirs:
            for attempt in range(60):
                try:
                    d.rmdir()
                    break
                except OSError:
                    # processes may still be exiting; kill stragglers then retry
                    try:
                        for pid in (d / "cgroup.procs").read_text().split():
                            os.kill(int(pid), 9)
                    except OSError:
                        pass
                    time.sleep(0.001 * min(2 ** attempt, 20))


# ---------------------------------------------------------------- command lines
_BWRAP_OK: bool | None = None
_WARNED = False


def bwrap_available() -> bool:
    global _BWRAP_OK
    if _BWRAP_OK is None:
        exe = shutil.which("bwrap")
        _BWRAP_OK = False
        if exe:
            try:
                cmd = _bwrap_prefix([]) + [_python(), "-I", "-S", "-c", "print(1)"]
                out = subprocess.run(cmd, capture_output=True, timeout=20)
                _BWRAP_OK = out.returncode == 0 and out.stdout.strip() == b"1"
            except (OSError, subprocess.TimeoutExpired):
                _BWRAP_OK = False
    return _BWRAP_OK


def resolve_mode(mode: str) -> str:
    global _WARNED
    if mode == "process":
        return "process"
    if bwrap_available():
        return "bwrap"
    if mode == "bwrap":
        raise RuntimeError("sandbox.mode is 'bwrap' but bubblewrap does not work here (apt-get install bubblewrap)")
    if not _WARNED:
        warnings.warn(
            "bubblewrap not available: harnesses run as plain subprocesses with rlimits and a scrubbed "
            "environment; this is NOT a security boundary (no filesystem or network isolation).",
            stacklevel=2,
        )
        _WARNED = True
    return "process"


def _python() -> str:
    return os.path.realpath(sys.executable)


def _stdlib_dirs() -> list[str]:
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix, "installed_base": sys.base_prefix}
    paths = sysconfig.get_paths(vars=base)
    return sorted({paths["stdlib"], paths["platstdlib"]})


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def world_readable_stdlib() -> bool:
    """Whether an unprivileged uid can import the stdlib in place (matters without bubblewrap)."""
    for d in _stdlib_dirs():
        for a in [*_ancestors(d), d]:
            try:
                if not os.stat(a).st_mode & 0o001:
                    return False
            except OSError:
                return False
    return True


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise ValueError(f"sandbox.extra_packages: package '{name}' is not installed")
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return spec.origin


def _bwrap_prefix(extra_packages: list[str]) -> list[str]:
    cmd = ["bwrap", "--die-with-parent", "--new-session", "--clearenv",
           "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if os.getuid() != 0:
        cmd.append("--unshare-user")
    cmd += ["--ro-bind", "/usr", "/usr"]
    for link in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(link):
            cmd += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            cmd += ["--ro-bind", link, link]
    if os.path.exists("/etc/ld.so.cache"):
        cmd += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    python = _python()
    # bwrap creates missing parents of bind targets as root-only dirs; pre-create them world-
    # traversable, or the harness (running as an unprivileged uid) cannot import the stdlib
    targets = [python, os.path.join(sys.base_prefix, "lib"), *_stdlib_dirs()]
    ancestors = sorted({a for t in targets if not t.startswith("/usr/") for a in _ancestors(t)},
                       key=lambda a: a.count("/"))
    for a in ancestors:
        cmd += ["--perms", "0755", "--dir", a]
    if not python.startswith("/usr/"):
        cmd += ["--ro-bind", python, python]
        libdir = os.path.join(sys.base_prefix, "lib")
        if os.path.isdir(libdir) and not libdir.startswith("/usr/"):
            for entry in os.listdir(libdir):
                if entry.startswith("libpython"):
                    p = os.path.join(libdir, entry)
                    cmd += ["--ro-bind", p, p]
    for d in _stdlib_dirs():
        if not d.startswith("/usr/"):
            cmd += ["--ro-bind", d, d]
        for sub in ("site-packages", "dist-packages"):
            if os.path.isdir(os.path.join(d, sub)):
                cmd += ["--tmpfs", os.path.join(d, sub)]
    for d in ("/usr/lib/python3/dist-packages", "/usr/local/lib"):
        if os.path.isdir(d):
            cmd += ["--tmpfs", d]
    for name in extra_packages:
        src = _package_dir(name)
        cmd += ["--ro-bind", src, f"{SANDBOX_SITE}/{os.path.basename(src)}"]
    cmd += ["--ro-bind", str(WORKER), SANDBOX_WORKER_PATH,
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp",
            "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8"]
    return cmd


def worker_command(mode: str, cfg: SandboxConfig, args: list[str]) -> tuple[list[str], dict[str, str], str | None]:
    """argv, environment and cwd for a worker process in `mode`."""
    if mode == "bwrap":
        return _bwrap_prefix(cfg.extra_packages) + [_python(), "-I", "-S", "-B", SANDBOX_WORKER_PATH, *args], {}, None
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
    return [_python(), "-I", "-S", "-B", str(WORKER), *args], env, None


def _extra_paths(mode: str, cfg: SandboxConfig) -> list[str]:
    if mode == "bwrap":
        return [SANDBOX_SITE] if cfg.extra_packages else []
    return sorted({os.path.dirname(_package_dir(n)) for n in cfg.extra_packages})


def _limits(cfg: SandboxConfig) -> dict[str, int]:
    return {"memory_mb": cfg.memory_mb, "cpu_seconds": cfg.cpu_seconds,
            "max_processes": cfg.max_processes, "file_bytes": 16 * 1024 * 1024}


# ---------------------------------------------------------------- one-shot code execution (tools)
def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 512, output_chars: int = 4000,
               mode: str = "auto") -> str:
    """Run a Python snippet in a fresh sandboxed process; return its output. Never raises."""
    try:
        actual = resolve_mode(mode)
    except RuntimeError as e:
        return f"SandboxError: {e}"
    cfg = SandboxConfig(mode=actual, memory_mb=memory_mb, max_processes=8, cpu_seconds=int(timeout_s) + 1)
    uid = UIDS.take() if actual == "bwrap" or world_readable_stdlib() else None
    limits = json.dumps(_limits(cfg))
    argv, env, cwd = worker_command(actual, cfg, ["--snippet", limits, "none" if uid is None else str(uid)])
    cgroup = Cgroup.create(memory_mb * 1024 * 1024, 16)
    try:
        proc = subprocess.Popen(cgroup.command(argv) if cgroup else argv, env=env, cwd=cwd, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        UIDS.give(uid)
        return f"SandboxError: {e}"
    chunks: list[bytes] = []
    size = 0

    def pump():
        nonlocal size
        while True:
            data = proc.stdout.read1(65536)  # a PIPE is buffered: read1 returns what is there
            if not data:
                return
            if size < output_chars * 4:
                chunks.append(data)
            size += len(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.stdin.write(code.encode())
        proc.stdin.close()
    except OSError:
        pass
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    try:
        os.killpg(proc.pid, 9)
    except OSError:
        pass
    proc.wait()
    reader.join(timeout=2)
    if cgroup:
        cgroup.remove()
    UIDS.give(uid)
    out = b"".join(chunks).decode(errors="replace")
    if len(out) > output_chars:
        out = out[:output_chars] + "\n...[output truncated]"
    if timed_out:
        return (out + f"\nTimeoutError: code ran longer than {timeout_s:g} s").strip()
    return out
