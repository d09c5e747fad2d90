"""Runs the vLLM server as a child and ends its whole process group when WHALE's process dies.

Why: the server runs in its own session (so `VLLMEngine.close()` can end it and the engine-core
processes it forks), which also means a SIGKILL of `whale run` does not reach it; without this, a
killed run leaves a server holding memory (or a GPU) and the resumed run's server fails to start.
`PR_SET_PDEATHSIG` would tie the server to the *thread* that started it (servers are restarted
from worker threads), so this polls the parent pid instead.

Usage (by whale.engine.vllm_server): python vllm_watchdog.py PARENT_PID CMD...  It exits with
the server's exit code (128 + signal when the server was killed by a signal). Stdlib only, and run
by path, not as part of the whale package, so it starts in milliseconds with any python.
"""

import os
import signal
import subprocess
import sys
import time


def end_group(grace_s: float = 20.0) -> None:
    """SIGTERM the process group (the server shuts its engine cores down), SIGKILL what is left."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(0, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break  # no children left; engine cores reparented elsewhere get the SIGKILL below
        os.killpg(0, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> int:
    parent, cmd = int(sys.argv[1]), sys.argv[2:]
    server = subprocess.Popen(cmd)  # same process group: ours, the session leader's
    signal.signal(signal.SIGTERM, lambda *_: (end_group(), os._exit(143)))
    while True:
        try:
            code = server.wait(timeout=1.0)  # exit right after the server does: WHALE sees its code at once
            break
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:  # WHALE's process is gone (SIGKILL, crash): take the server with us
            end_group()
            return 1
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
