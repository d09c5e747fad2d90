"""The hf engine as of commit 1c4ff05 (static batches, DynamicCache), loaded from git for comparisons.

Benchmarks measure the current engine against it side by side in one process; nothing in the
product imports this. Needs the repository's git history (`git show 1c4ff05:whale/engine/hf.py`).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

LEGACY_COMMIT = "1c4ff05"


def load_legacy_hf() -> types.ModuleType:
    """The module whale/engine/hf.py of LEGACY_COMMIT, imported under the name `whale_legacy_hf`."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{LEGACY_COMMIT}:whale/engine/hf.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("whale_legacy_hf")
    module.__file__ = f"<{LEGACY_COMMIT}:whale/engine/hf.py>"
    sys.modules[module.__name__] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def legacy_engine(path: str, **kwargs):
    """A 1c4ff05 HFEngine; it answers `generate` only (one static batch per call)."""
    return load_legacy_hf().HFEngine(path, **kwargs)
