"""The proposer's workspace: a read-only copy of the archive, BRIEF.md and a writable candidates/.

It lives outside the run directory (under `harness.workspace_root`, by default a private folder
in the system temp dir), so nothing relative to it leads to the run's evaluations, training rows
or the real archive. The copy holds only harness code, meta, scores, harness-split traces,
summary and frontier; harness code is copied through `Archive.source`, so a proposer always
reads the pinned, validated bytes. Files are *copied* (a hard link would let a root agent write
through to the real archive), made 0444 / folders 0555; mode bits do not bind root, so the
agent sandbox (agent_sandbox.py) also mounts the copy read-only. Only `candidates/*.py` is read
back, and the whole workspace is deleted after each round.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

from whale.harness.archive import Archive
from whale.harness.proposal import Proposal, proposal_from_source

ARCHIVE_FILES = ("meta.json", "scores.json", "traces.jsonl")  # besides harness.py
ARCHIVE_ROOT_FILES = ("summary.jsonl", "frontier.json")
CANDIDATE_MAX_BYTES = 1_000_000  # larger files are skipped unread (validation caps far lower)


def proposer_workspace_root(configured: str | None, run_dir: Path) -> Path:
    """Where this run's proposer workspaces go: one private folder per run directory.

    The folder name carries a hash of the run directory's absolute path, so two runs never share
    (and never delete) each other's workspaces.
    """
    if configured:
        base = Path(configured).expanduser().resolve()
    else:
        base = Path(tempfile.gettempdir()).resolve() / f"whale-proposers-{os.getuid()}"
    run = Path(run_dir).resolve()
    root = base / f"{run.name}-{hashlib.sha256(str(run).encode()).hexdigest()[:10]}"
    check_outside(root, run)
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    if base.stat().st_uid != os.getuid():  # a shared temp dir: someone else made it first
        raise ValueError(f"proposer workspace root {base} belongs to another user; set harness.workspace_root")
    return root


def check_outside(workspace: Path, run_dir: Path) -> None:
    """A workspace inside the run directory (or holding it) would put the run's test gold, rows
    and real archive a `..` away from the agent."""
    ws, run = Path(workspace).resolve(), Path(run_dir).resolve()
    if ws == run or run in ws.parents or ws in run.parents:
        raise ValueError(f"proposer workspace {ws} must be outside the run directory {run} "
                         "(set harness.workspace_root to a folder elsewhere)")


def _make_read_only(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def _make_writable(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o644)


def remove_tree(root: Path) -> None:
    if Path(root).is_dir() and not Path(root).is_symlink():
        _make_writable(root)
    shutil.rmtree(root, ignore_errors=True)


def file_mode_is_read_only(path: Path) -> bool:
    return not (os.stat(path).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def build_workspace(archive: Archive, workspace: Path, brief: str) -> Path:
    """workspace/{archive/ (read-only copy), candidates/ (writable), BRIEF.md}; returns archive/."""
    workspace = Path(workspace)
    check_outside(workspace, archive.run_dir)
    remove_tree(workspace)
    copy = workspace / "archive"
    copy.mkdir(parents=True)
    os.chmod(workspace, 0o700)
    for name in ARCHIVE_ROOT_FILES:
        if (archive.root / name).exists():
            shutil.copyfile(archive.root / name, copy / name)
    for cid in archive.ids():
        (copy / cid).mkdir()
        (copy / cid / "harness.py").write_text(archive.source(cid))
        for name in ARCHIVE_FILES:
            src = archive.root / cid / name
            if src.is_file() and not src.is_symlink():
                shutil.copyfile(src, copy / cid / name)
    _make_read_only(copy)
    (workspace / "candidates").mkdir()
    (workspace / "BRIEF.md").write_text(brief)
    os.chmod(workspace / "BRIEF.md", 0o444)
    return copy


def collect_candidates(folder: Path, n: int, default_parent: str | None) -> tuple[list[Proposal], list[str]]:
    """Up to `n` regular `*.py` files of `folder` (sorted by name) and a note per file skipped.

    Symlinks, fifos and files over CANDIDATE_MAX_BYTES are skipped unread: a proposer must not be
    able to make the parent read something else, block, or fill its memory.
    """
    out, skipped = [], []
    for path in sorted(Path(folder).glob("*.py")):
        if len(out) >= max(0, n):
            break
        if path.is_symlink() or not path.is_file():
            skipped.append(f"{path.name}: not a regular file")
            continue
        with open(path, "rb") as f:
            data = f.read(CANDIDATE_MAX_BYTES + 1)
        if len(data) > CANDIDATE_MAX_BYTES:
            skipped.append(f"{path.name}: over {CANDIDATE_MAX_BYTES} bytes")
            continue
        out.append(proposal_from_source(data.decode(errors="replace"), notes=f"file {path.name}",
                                        default_parent=default_parent))
    return out, skipped
