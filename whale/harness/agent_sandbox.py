"""The coding agent's sandbox: bubblewrap with only the workspace writable and the network on.

A coding agent is a whole program (Node for Claude Code, a Rust binary for Codex) that runs shell
commands of its own choosing, so "only read the archive" must be enforced by what its process can
see, not by asking. The mount namespace bwrap builds holds:
- read-only: /usr (with every Python site-/dist-packages folder under it hidden by an empty
  tmpfs: installed packages may carry datasets or this product), /bin /lib /lib64 /sbin, an
  allowlist of /etc entries (DNS, TLS certificates, users, time zone, loader), and the agent's own
  install folder when it lives outside /usr (for an npm install its whole node_modules tree);
- an empty tmpfs for $HOME, /tmp; fresh /proc (new PID namespace) and a minimal /dev;
- the configured binds (the agent's config such as ~/.claude: read-only, read-write, or for a
  file a private copy);
- the workspace read-write, with its archive/ and BRIEF.md mounted read-only on top.
Nothing else exists inside: not the run directory, the project tree, other runs, datasets, the HF
cache or ~/.cache. The network namespace is the host's (agents call their API). As root, bwrap
keeps every capability unless told otherwise (a root agent could remount the read-only binds),
so root gets `--cap-drop ALL`; others get a user namespace, in which bwrap drops them itself.
The environment is exactly the dict handed to the process (bwrap inherits it), so API keys never
appear on a command line.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import whale

BWRAP = "bwrap"
SYSTEM_LINKS = ("/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin")
ETC_ENTRIES = ("resolv.conf", "hosts", "host.conf", "nsswitch.conf", "gai.conf", "ssl", "ca-certificates",
               "ca-certificates.conf", "pki", "passwd", "group", "localtime", "timezone", "alternatives",
               "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "os-release", "mime.types")
HIDDEN_PYTHON_GLOBS = ("/usr/lib/python3/dist-packages", "/usr/lib/python3*/site-packages",
                       "/usr/lib/python3*/dist-packages", "/usr/local/lib/python3*/site-packages",
                       "/usr/local/lib/python3*/dist-packages")
PACKAGE_DIR = Path(whale.__file__).resolve().parent.parent  # the product's own tree
BIND_MODES = ("ro", "rw", "copy")


@dataclass(frozen=True)
class Bind:
    """A host path the agent sees at the same path: `mode` ro / rw (a bind mount) or copy (a
    file copied into the sandbox, writable, changes discarded: a file bind mount would make the
    agent's own atomic rewrite of it fail with EBUSY, as Claude Code's of ~/.claude.json does).
    `required`: a missing path is an error (configured binds) rather than skipped (a preset's)."""

    path: Path
    mode: str = "ro"
    required: bool = True


def expand(path: str) -> Path:
    return Path(os.path.expanduser(path)).absolute()


def check_bind_paths(binds: Iterable[Bind]) -> None:
    """A configured bind must exist, and a copy must be a file."""
    for b in binds:
        if b.mode not in BIND_MODES:
            raise ValueError(f"harness.agent_binds: mode of {b.path} must be one of {', '.join(BIND_MODES)}, got {b.mode!r}")
        if b.required and not os.path.lexists(b.path):
            raise ValueError(f"harness.agent_binds: {b.path} does not exist")
        if b.mode == "copy" and os.path.exists(b.path) and not os.path.isfile(b.path):
            raise ValueError(f"harness.agent_binds: {b.path} is not a file; mode 'copy' is for files")


def check_binds(binds: Iterable[Bind], run_dir: Path, source_tree: bool = True) -> None:
    """Refuse a bind that would put the run directory or (`source_tree`) the product's tree inside
    the sandbox. The agent's own install folder is checked against the run only: a `node_modules`
    folder of an ignored `.agents/` in a checkout holds npm packages, none of the product."""
    secrets = [(Path(run_dir).resolve(), "the run directory")]
    if source_tree:
        secrets.append((PACKAGE_DIR, "the whale source tree"))
    for b in binds:
        p = b.path.resolve()
        for secret, what in secrets:
            if p == secret or p in secret.parents or secret in p.parents:
                raise ValueError(f"harness.agent_binds: {b.path} would expose {what} ({secret}) to the agent")


def executable_binds(name: str, search_path: str) -> list[Bind]:
    """Read-only binds that make executable `name` (found on `search_path`) runnable inside.

    Nothing when it lives under /usr (already visible). An npm install (the file resolves into a
    `node_modules` folder): that whole `node_modules` tree, because launchers look for their
    native packages beside them (Codex's `codex.js` needs `@openai/codex-linux-x64`, and finds it
    only under a folder named node_modules). Otherwise the file's own folder (a native binary
    such as ~/.local/share/claude/versions). Plus its folder on PATH when that is elsewhere (for
    an nvm or ~/.local install that is also where `node` sits).
    """
    found = shutil.which(name, path=search_path)
    if found is None:
        return []
    real = Path(found).resolve()
    modules = [p for p in real.parents if p.name == "node_modules"]
    target = modules[-1] if modules else real.parent  # the outermost: nested installs share its packages
    on_path = Path(found).parent
    paths = [target] if target == on_path or target in on_path.parents else [on_path, target]
    return [Bind(p, "ro") for p in dict.fromkeys(paths) if not str(p).startswith("/usr/")]


def _system_mounts() -> list[str]:
    cmd = ["--ro-bind", "/usr", "/usr"]
    for link in SYSTEM_LINKS:
        if os.path.islink(link):
            cmd += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            cmd += ["--ro-bind", link, link]
    for pattern in HIDDEN_PYTHON_GLOBS:
        for d in sorted(glob.glob(pattern)):
            if os.path.isdir(d) and not os.path.islink(d):
                cmd += ["--tmpfs", d]
    for entry in ETC_ENTRIES:
        cmd += ["--ro-bind-try", f"/etc/{entry}", f"/etc/{entry}"]
    return cmd


def _prefix(home: str | None) -> list[str]:
    cmd = [BWRAP, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try"]
    cmd += ["--cap-drop", "ALL"] if os.getuid() == 0 else ["--unshare-user"]
    cmd += _system_mounts() + ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if home and home != "/":
        cmd += ["--tmpfs", home]
    return cmd


@contextmanager
def open_copies(binds: Sequence[Bind]) -> Iterator[dict[Path, int]]:
    """File descriptors of the existing `copy` binds, for bwrap's --file (closed afterwards)."""
    fds: dict[Path, int] = {}
    try:
        for b in binds:
            if b.mode == "copy" and os.path.isfile(b.path):
                fds[b.path] = os.open(b.path, os.O_RDONLY)
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def bwrap_argv(workspace: Path, binds: Sequence[Bind], home: str | None, command: Sequence[str],
               copy_fds: dict[Path, int] | None = None) -> list[str]:
    """The full bwrap command line that runs `command` in `workspace` (see the module docstring).
    A `copy` bind appears only with its descriptor in `copy_fds` (open_copies)."""
    cmd = _prefix(home)
    for b in binds:
        if b.mode == "copy":
            if b.path in (copy_fds or {}):
                cmd += ["--perms", "0600", "--file", str(copy_fds[b.path]), str(b.path)]
            continue
        flag = ("--bind" if b.mode == "rw" else "--ro-bind") + ("" if b.required else "-try")
        cmd += [flag, str(b.path), str(b.path)]
    ws = str(Path(workspace).absolute())
    cmd += ["--bind", ws, ws, "--ro-bind", f"{ws}/archive", f"{ws}/archive",
            "--ro-bind", f"{ws}/BRIEF.md", f"{ws}/BRIEF.md", "--chdir", ws]
    return cmd + ["--", *command]


def bwrap_problem() -> str | None:
    """None when bubblewrap runs the agent prefix here, else why not (one line)."""
    if shutil.which(BWRAP) is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        out = subprocess.run(_prefix(None) + ["--", "/bin/sh", "-c", "true"], capture_output=True, timeout=30,
                             env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not start: {e}"
    if out.returncode != 0:
        return f"bwrap failed: {out.stderr.decode(errors='replace').strip()[:300]}"
    return None


def agent_env(names: Iterable[str], home: str | None) -> dict[str, str]:
    """PATH, HOME, LANG and the named variables that are set in the parent; nothing else."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": os.environ.get("LANG", "C.UTF-8")}
    if home:
        env["HOME"] = home
    env.update({k: os.environ[k] for k in names if k in os.environ})
    return env
