"""Failures a machine or a user causes, each told as one line: what failed, where, what to do.

`WhaleError` carries that line (`str(e)`); code that knows what went wrong raises one (a damaged
state.json, a model the hub cannot serve, an engine that will not start). Library errors whose
type already says it (an `OSError` with errno ENOSPC, EROFS, ...; a missing module) are phrased by
`describe`, so callers need no try/except for them. The command line (cli.py) is the one place
that turns any exception into `describe`'s line, writes the traceback to a log file
(`write_log`) and exits non-zero; an exception `describe` does not know is an internal error,
named by its type, with the traceback in the same log.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NoReturn


class WhaleError(Exception):
    """A failure phrased for the user. `details`: more text for the log file (a server's last log
    lines), never printed on the terminal; `resumable`: a run that died of it continues with
    `whale run --resume` once the cause is fixed."""

    exit_code = 1
    resumable = True

    def __init__(self, line: str, details: str = ""):
        super().__init__(line)
        self.details = details


class DamagedFile(WhaleError):
    """A file of the run directory that is not what WHALE wrote (it writes them atomically)."""

    resumable = False


class ModelUnavailable(WhaleError, ValueError):
    """A model name that is neither a local folder nor a model the Hugging Face hub can serve here.
    Not `resumable`: the saved config names the model, so a misspelt one needs a new run."""

    resumable = False


class MissingPackage(WhaleError, ImportError):
    """An optional package the configuration needs is not installed."""


class EngineStartError(WhaleError, RuntimeError):
    """The inference engine (a vLLM server) did not start."""


class WorkerFailed(WhaleError, RuntimeError):
    """Rollout workers (Ray actors) that died or could not start."""


class RunDirBusy(WhaleError):
    """Another process holds the run directory (a run or a resume of it is still going)."""


class StorageError(WhaleError):
    """The disk refused a write: full, read-only, no permission, or the folder vanished."""


# errno -> what happened and what to do, for writes into a run directory or a cache
_OS_REASONS = {
    errno.ENOSPC: ("no space left on the device", "free some space (or move the folder to a larger disk)"),
    errno.EDQUOT: ("disk quota exceeded", "free some space or raise the quota"),
    errno.EROFS: ("read-only file system", "make it writable (or copy the folder to a writable disk)"),
    errno.EACCES: ("permission denied", "make it writable for this user"),
    errno.EPERM: ("operation not permitted", "make it writable for this user"),
    errno.ENOENT: ("no such file or directory", "check the path, or put back what was moved or deleted"),
    errno.EIO: ("input/output error: the disk failed", "check the disk (dmesg)"),
}
_STRERRORS = {os.strerror(code): code for code in _OS_REASONS if code != errno.ENOENT}


def _chain(exc: BaseException):
    """`exc` and the exceptions it was raised from or during, outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def raise_naming(exc: BaseException, path: str | os.PathLike) -> NoReturn:
    """Raise `exc` again; an OSError that names no file (a write that fails at flush or close, as on
    a full disk) as one that names `path`, so the user's line says which file."""
    if isinstance(exc, OSError) and not exc.filename and exc.errno:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    raise exc


def os_errno(exc: BaseException) -> int | None:
    """The errno behind `exc` (an OSError in its chain, or a library's message with the OS's words for
    it: safetensors writes 'I/O error: No space left on device (os error 28)'), when it is a known one."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _OS_REASONS:
            return e.errno
        for text, code in _STRERRORS.items():
            if text in str(e):
                return code
    return None


def storage_error(exc: BaseException, path: str | os.PathLike, doing: str) -> StorageError | None:
    """A StorageError for a failed write under `path` while `doing` (e.g. "saving weights w3"), or None
    when the disk is not the cause. Libraries that hide the errno (torch.save says only 'file write
    failed') are judged by the disk itself: no free space left, or a read-only mount."""
    code = os_errno(exc)
    if code is None:
        code = _disk_state(Path(path))
    if code is None:
        return None
    what, fix = _OS_REASONS[code]
    return StorageError(f"{doing} failed: {what} ({path}); {fix}")


def _disk_state(path: Path) -> int | None:
    folder = next((p for p in (path, *path.parents) if p.exists()), None)
    if folder is None:
        return errno.ENOENT
    if shutil.disk_usage(folder).free < 1 << 20:
        return errno.ENOSPC
    if not os.access(folder, os.W_OK):
        return errno.EROFS if os.statvfs(folder).f_flag & os.ST_RDONLY else errno.EACCES
    return None


def describe(exc: BaseException) -> str:
    """The one line for `exc`: a WhaleError's own, else the first cause in its chain that a user can fix."""
    return " ".join(_describe(exc).split())


def _describe(exc: BaseException) -> str:
    for e in _chain(exc):
        if isinstance(e, WhaleError):
            return str(e)
        if isinstance(e, OSError) and e.errno in _OS_REASONS:
            what, fix = _OS_REASONS[e.errno]
            where = f" ({e.filename})" if e.filename else ""
            return f"{what}{where}; {fix}"
        if isinstance(e, ModuleNotFoundError) and e.name:
            return (f"the package that provides '{e.name}' is not installed; install it (the optional extras are "
                    f"listed in README.md, e.g. pip install 'whale-opt[vllm]')")
        if isinstance(e, MemoryError):
            return "out of memory; lower runner.concurrency or model.max_batch_size, or use a smaller model"
    text = " ".join(str(exc).split())
    return f"internal error: {type(exc).__name__}: {text[:300]}"


def exit_code(exc: BaseException) -> int:
    return next((e.exit_code for e in _chain(exc) if isinstance(e, WhaleError)), 1)


def resumable(exc: BaseException) -> bool:
    return next((e.resumable for e in _chain(exc) if isinstance(e, WhaleError)), True)


def write_log(exc: BaseException, folder: str | os.PathLike | None) -> Path | None:
    """Append the command line, the time and the traceback to `folder`/error.log; when that folder
    cannot take it (the very disk that failed), to a file in the system's temp folder. None if
    neither could be written."""
    text = (f"==== {time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()}: {' '.join(sys.argv)}\n"
            + "".join(traceback.format_exception(exc)))
    details = [e.details for e in _chain(exc) if isinstance(e, WhaleError) and e.details]
    text += "".join(f"---- details\n{d.rstrip()}\n" for d in details)
    targets = [Path(folder) / "error.log"] if folder is not None and Path(folder).is_dir() else []
    targets.append(Path(tempfile.gettempdir()) / f"whale-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    for path in targets:
        try:
            with open(path, "a") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return None
