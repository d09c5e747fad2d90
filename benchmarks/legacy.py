"""The hf engine and the rollout runner as of commit 1c4ff05, loaded from git for comparisons.

At 1c4ff05 the engine ran static batches over a DynamicCache and the runner gathered llm() calls
into those batches (flushed when every live episode waited, or after a window). Benchmarks measure
the current code against them side by side in one process; nothing in the product imports this.
Needs the repository's git history (`git show 1c4ff05:<path>`).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

LEGACY_COMMIT = "1c4ff05"


def load_legacy(path: str) -> types.ModuleType:
    """The module at `path` (e.g. whale/engine/hf.py) of LEGACY_COMMIT, imported as `whale_legacy_<name>`."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{LEGACY_COMMIT}:{path}"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("whale_legacy_" + Path(path).stem)
    module.__file__ = f"<{LEGACY_COMMIT}:{path}>"
    sys.modules[module.__name__] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def legacy_engine(path: str, **kwargs):
    """A 1c4ff05 HFEngine; it answers `generate` only (one static batch per call)."""
    return load_legacy("whale/engine/hf.py").HFEngine(path, **kwargs)


def legacy_runner(engine, domain, cfg):
    """A 1c4ff05 RolloutRunner (its batcher calls engine.generate); the sandbox and domains are today's."""
    from whale.harness import runner  # its grading function: worker processes cannot import the copy

    module = load_legacy("whale/harness/runner.py")
    module._grade_in_worker = runner._grade_in_worker
    return module.RolloutRunner(engine, domain, _with_legacy_runner_keys(cfg))


def _with_legacy_runner_keys(cfg):
    """`cfg` with the runner keys 1c4ff05 read and today's config no longer has, at their defaults
    then (its batcher's flush window); the rest as given."""
    runner = types.SimpleNamespace(**dict(cfg.runner), batch_window_ms=20.0)
    return types.SimpleNamespace(**{**{name: getattr(cfg, name) for name in type(cfg).model_fields}, "runner": runner})
