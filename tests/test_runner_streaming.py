"""The runner hands each llm() call to the engine as it arrives: no episode waits for another's call."""

import threading
import time
from concurrent.futures import Future

from toy import ToyDomain
from whale.config import Config
from whale.engine.base import Generation, wait_all
from whale.rollout.runner import RolloutRunner

HARNESS = '''
def run(env, llm):
    if env.question.startswith("What is 0 "):
        out = llm([{"role": "user", "content": "slow " + env.question}])
    else:
        for _ in range(3):
            out = llm([{"role": "user", "content": env.question}])
    env.submit(str(out))
'''


class GatedEngine:
    """Answers at once, except a call marked "slow": it is held until three other calls were answered
    (or 20 s passed), like a long sample sharing the engine with short ones."""

    returns_ids = False
    weight_sync = "none"
    weights_version = "base"

    def __init__(self):
        self.fast_calls = 0
        self.released = threading.Event()
        self.lock = threading.Lock()

    def submit(self, request, sampling):
        future: Future = Future()
        if request.messages[-1]["content"].startswith("slow"):
            def later():
                self.released.wait(20)
                future.set_result([Generation(text="slow", finish_reason="stop")])

            threading.Thread(target=later, daemon=True).start()
            return future
        with self.lock:
            self.fast_calls += 1
            if self.fast_calls == 3:
                self.released.set()
        future.set_result([Generation(text="3", finish_reason="stop")])
        return future

    def generate(self, requests, sampling):
        return wait_all([self.submit(r, sampling) for r in requests])

    def count_tokens(self, messages):
        return 1

    def lockstep(self, clients, hold_s=1.0):
        return None  # answers by its own timing rule: no deterministic batches

    def load_weights(self, path, version):
        pass

    def close(self):
        pass


def test_next_call_does_not_wait_for_an_unrelated_call():
    cfg = Config()
    cfg.runner.concurrency = 2
    cfg.domain.budget.seconds = 60
    engine = GatedEngine()
    runner = RolloutRunner(engine, ToyDomain(2), cfg)
    try:
        t0 = time.monotonic()
        slow, fast = runner.run(HARNESS, ToyDomain(2).problems)
        elapsed = time.monotonic() - t0
    finally:
        runner.close()
    assert fast.error is None and fast.reward == 1.0 and len(fast.calls) == 3
    assert slow.error is None and slow.answer == "slow"
    # the fast episode made all three calls while the slow call was still in the engine
    assert engine.fast_calls == 3 and elapsed < 15, elapsed
    assert runner.stats["llm_calls"] == 4


CHILD = """
import os, sys, time
sys.path.insert(0, {tests!r})
from toy import ToyDomain
from whale.config import Config
from whale.engine.null import NullEngine
from whale.rollout.runner import RolloutRunner
runner = RolloutRunner(NullEngine(), ToyDomain(2), Config())
print(runner._pool().submit(os.getpid).result(), flush=True)
time.sleep(600)
"""


def test_grader_workers_exit_when_their_run_is_sigkilled(tmp_path):
    """A SIGKILLed run cannot shut its grader pool down; the workers must not outlive it."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=tests)], stdout=subprocess.PIPE, text=True)
    worker = int(child.stdout.readline())
    os.kill(worker, 0)  # alive while its run is
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{worker}/status").exists() and "zombie" in Path(f"/proc/{worker}/status").read_text():
            return
        time.sleep(0.2)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError(f"grader worker {worker} outlived its SIGKILLed run by 15 s")
