"""Fork server for the SIGKILL resume tests (tests only, not product code).

Starting `whale run` costs seconds of imports (torch, transformers, peft) before any work, and
the resume tests start it about thirty times. This process imports everything once and then runs
each run in a forked child, exactly as `whale run` / `whale run --resume` would; the child is what
the WHALE_TEST_KILL_AT hook SIGKILLs. The server itself never starts threads, so forking is safe.

Protocol: one JSON request per line on stdin, {"chains": {name: {"config": path, "out": dir,
"points": [kill point, ...]}}, "parallel": n}. A chain starts `config` into `out` killed at the
first point, resumes it killed at each further point, and resumes it once more to the end; up to
`parallel` chains run at once (one per core: each run is single-threaded). The answer is one JSON
line, {name: [{"kill_at": point or null, "killed": bool, "code": int}, ...]}, with each run's
output in `<out>.log`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import whale.cli  # noqa: F401  (sets the environment `whale run` runs under)
from whale.config import load_config
from whale.run import run_experiment
from whale.store import KILL_ENV


def in_child(fn, log_path: str) -> int:
    """Run `fn` in a forked child with its output in `log_path`; return its wait status."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(log, 1)
            os.dup2(log, 2)
            fn()
        except BaseException:  # noqa: BLE001 - report any failure as an exit code
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return os.waitpid(pid, 0)[1]


def run_once(config: str | None, out: str, kill_at: str | None) -> None:
    """Like `whale run CONFIG --out OUT` (or `--resume OUT`), with the kill hook set to `kill_at`."""
    if kill_at:
        os.environ[KILL_ENV] = kill_at
    else:
        os.environ.pop(KILL_ENV, None)
    if config:
        run_experiment(load_config(config), out=out)
    else:
        run_experiment(None, resume=out)


def run_chain(chain: dict, result_path: str) -> None:
    results = []
    points = list(chain["points"]) + [None]
    for i, point in enumerate(points):
        status = in_child(lambda: run_once(chain["config"] if i == 0 else None, chain["out"], point),
                          chain["out"] + ".log")
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        results.append({"kill_at": point, "killed": killed, "code": os.waitstatus_to_exitcode(status)})
        if killed != (point is not None):
            break  # a kill point never reached, or a run that should have finished did not
    with open(result_path, "w") as f:
        json.dump(results, f)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        waiting = list(request["chains"].items())
        running: dict[int, tuple[str, str]] = {}
        answers = {}
        while waiting or running:
            while waiting and len(running) < max(1, request.get("parallel", 1)):
                name, chain = waiting.pop(0)
                result_path = chain["out"] + ".result.json"
                pid = os.fork()
                if pid == 0:
                    try:
                        run_chain(chain, result_path)
                    finally:
                        os._exit(0)
                running[pid] = (name, result_path)
            pid, _ = os.wait()
            name, result_path = running.pop(pid)
            crashed = [{"kill_at": None, "killed": False, "code": -1}]  # the chain process itself died
            answers[name] = json.load(open(result_path)) if os.path.exists(result_path) else crashed
        sys.stdout.write(json.dumps(answers) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
