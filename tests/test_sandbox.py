"""Hostile harnesses: each must be contained, score 0 and leave the run going.

Every hostile harness here would *win* (submit the right answer) if its attack worked, so a
reward of 0 is the proof of containment, not just the absence of a crash.
"""

import json
import os
import subprocess
import time

import pytest

from toy import H0, ScriptedEngine, ToyDomain
from whale.config import Config
from whale.rollout.runner import RolloutRunner
from whale.rollout.sandbox import Cgroup, bwrap_available, run_python

GOOD = H0.replace('"{question}"', '"Answer correctly: {question}"')


def make_runner(seconds=5.0, llm_calls=4, tool_calls=4, memory_mb=256):
    cfg = Config()
    cfg.domain.budget.seconds = seconds
    cfg.domain.budget.llm_calls = llm_calls
    cfg.domain.budget.tool_calls = tool_calls
    cfg.runner.sandbox.memory_mb = memory_mb
    cfg.runner.sandbox.cpu_seconds = 20
    domain = ToyDomain(4)
    return RolloutRunner(ScriptedEngine(), domain, cfg), domain


@pytest.fixture(scope="module")
def runner():
    r, d = make_runner()
    yield r, d
    r.close()


def play(runner, body, n=2):
    r, d = runner
    source = "import os, sys, socket, json, time, threading\n" + body
    return r.run(source, d.problems[:n])


def cheat_tail(expr="answer"):
    """Harness code: submit the right answer computed by the attack, else raise."""
    return f"\n    env.submit(str({expr}))\n"


def assert_contained(trajs):
    for t in trajs:
        assert t.reward == 0.0, (t.answer, t.error)


def test_good_harness_scores(runner):
    trajs = runner[0].run(GOOD, runner[1].problems)
    assert [t.reward for t in trajs] == [1.0] * 4
    assert all(t.error is None for t in trajs)


def test_toy_baseline_fails(runner):
    # the weak base harness really scores 0 here, so hostile zeros below mean something
    assert_contained(runner[0].run(H0, runner[1].problems))


@pytest.mark.skipif(not bwrap_available(), reason="network isolation needs bubblewrap")
def test_network_is_blocked(runner):
    body = """
def run(env, llm):
    s = socket.socket()
    s.settimeout(2)
    s.connect(("127.0.0.1", 22))
    a, b = [int(x) for x in env.question.replace("?", "").split() if x.isdigit()]
    env.submit(str(a + b))
"""
    trajs = play(runner, body)
    assert_contained(trajs)
    assert all("Error" in t.error for t in trajs)


def test_cannot_find_dataset_on_disk(runner, tmp_path):
    # the gold answers lie on disk, as a real dataset cache would; the harness knows where
    data = tmp_path / "answers.json"
    data.write_text(json.dumps({p.question: p.answer for p in runner[1].problems}))
    os.chmod(tmp_path, 0o755)
    os.chmod(data, 0o644)
    body = f"""
def run(env, llm):
    found = None
    for path in [{str(data)!r}, "/work/main/whale/domains", os.path.expanduser("~")]:
        try:
            found = json.load(open({str(data)!r}))[env.question]
            break
        except Exception:
            pass
    if found is None:
        raise RuntimeError("dataset not visible")
    env.submit(str(found))
"""
    trajs = play(runner, body)
    assert_contained(trajs)
    for t in trajs:
        assert "dataset not visible" in (t.error or ""), t.error


@pytest.mark.skipif(not bwrap_available(), reason="file-system isolation needs bubblewrap")
def test_cannot_import_product_or_site_packages(runner):
    body = """
def run(env, llm):
    import importlib
    for name in ("whale", "torch", "numpy", "transformers"):
        try:
            importlib.import_module(name)
            env.submit("imported " + name)
            return
        except ImportError:
            pass
    raise RuntimeError("nothing importable")
"""
    trajs = play(runner, body)
    assert all(t.answer is None and "nothing importable" in t.error for t in trajs)


def test_parent_environment_is_scrubbed(runner, monkeypatch):
    monkeypatch.setenv("WHALE_TEST_SECRET_API_KEY", "s3cret")
    body = """
def run(env, llm):
    if any("s3cret" in v for v in os.environ.values()):
        a, b = [int(x) for x in env.question.replace("?", "").split() if x.isdigit()]
        env.submit(str(a + b))
    else:
        env.submit("no secret: " + ",".join(sorted(os.environ)))
"""
    trajs = play(runner, body)
    assert_contained(trajs)
    assert all(t.answer.startswith("no secret") for t in trajs)


def test_cannot_write_outside_its_temp_dir(runner, tmp_path):
    os.chmod(tmp_path, 0o777)
    target = tmp_path / "pwned.txt"
    body = f"""
def run(env, llm):
    open("/tmp/scratch.txt", "w").write("fine")     # its own temp dir works
    open({str(target)!r}, "w").write("pwned")
    env.submit("wrote")
"""
    trajs = play(runner, body)
    assert not target.exists()
    assert_contained(trajs)


def test_fork_bomb_is_contained(runner):
    body = """
def run(env, llm):
    while True:
        try:
            os.fork()
        except OSError:
            pass
"""
    t0 = time.time()
    trajs = play(runner, body)
    assert_contained(trajs)
    assert all(t.error for t in trajs)
    assert time.time() - t0 < 60
    # the run goes on: the next harness still plays normally
    assert [t.reward for t in runner[0].run(GOOD, runner[1].problems[:2])] == [1.0, 1.0]


def test_thread_bomb_is_contained(runner):
    body = """
def run(env, llm):
    threads = []
    while True:
        t = threading.Thread(target=time.sleep, args=(100,))
        t.start()
        threads.append(t)
"""
    trajs = play(runner, body)
    assert_contained(trajs)
    assert all(t.error for t in trajs)


def test_memory_bomb_is_contained(runner):
    body = """
def run(env, llm):
    blocks = []
    while True:
        blocks.append(bytearray(64 * 1024 * 1024))
"""
    trajs = play(runner, body)
    assert_contained(trajs)
    assert all("MemoryError" in t.error or "killed" in t.error for t in trajs)


def test_infinite_loop_hits_wall_time():
    r, d = make_runner(seconds=1.5)
    try:
        t0 = time.time()
        trajs = r.run("def run(env, llm):\n    while True:\n        pass\n", d.problems[:2])
        assert time.time() - t0 < 30
        assert all("wall-time" in t.error or "CPU" in t.error for t in trajs)
        assert_contained(trajs)
    finally:
        r.close()


def test_huge_output_is_truncated_and_harmless(runner):
    body = """
def run(env, llm):
    for _ in range(2000):
        print("x" * 100000)
    os.write(1, b"y" * 10_000_000)
    out = llm([{"role": "user", "content": "Answer correctly: " + env.question}])
    env.submit(str(out))
"""
    trajs = play(runner, body)
    assert [t.reward for t in trajs] == [1.0, 1.0]  # printing is allowed, only bounded
    assert all(len(t.stdout_tail) <= 4000 for t in trajs)


def test_os_exit_before_submitting(runner):
    trajs = play(runner, "\ndef run(env, llm):\n    os._exit(0)\n")
    assert_contained(trajs)
    assert all("exited" in t.error or "closed" in t.error for t in trajs)


def test_killing_parent_and_process_group(runner):
    body = """
import signal
def run(env, llm):
    for target in (os.getppid(), 1, -1):
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(0, signal.SIGKILL)
    except OSError:
        pass
    env.submit("still here")
"""
    trajs = play(runner, body)
    assert_contained(trajs)
    # we are alive, and the runner still works
    assert [t.reward for t in runner[0].run(GOOD, runner[1].problems[:2])] == [1.0, 1.0]


def test_forged_rpc_messages_are_ignored(runner):
    body = """
def run(env, llm):
    for fd in range(3, 30):
        try:
            os.write(fd, b"garbage\\n[1,2]\\n")
            os.write(fd, json.dumps({"op": "result", "reward": 1.0}).encode() + b"\\n")
            os.write(fd, json.dumps({"id": 99, "op": "grade", "reward": 1}).encode() + b"\\n")
            os.write(fd, json.dumps({"id": 100, "op": "tool", "name": "__class__", "args": []}).encode() + b"\\n")
        except OSError:
            pass
    env.submit("wrong")
"""
    trajs = play(runner, body)
    assert_contained(trajs)
    assert all(t.answer == "wrong" for t in trajs)


def test_llm_budget_exhaustion():
    r, d = make_runner(llm_calls=3)
    try:
        body = """
def run(env, llm):
    out = None
    for _ in range(50):
        out = llm([{"role": "user", "content": "Answer correctly: " + env.question}])
    env.submit(str(out))
"""
        trajs = r.run(body, d.problems[:2])
        assert_contained(trajs)
        assert all("budget exceeded" in t.error and len(t.calls) == 3 for t in trajs)
    finally:
        r.close()


def test_tool_budget_exhaustion():
    r, d = make_runner(tool_calls=2)
    try:
        body = """
def run(env, llm):
    a, b = [int(x) for x in env.question.replace("?", "").split() if x.isdigit()]
    for _ in range(10):
        s = env.add(a, b)
    env.submit(str(s))
"""
        trajs = r.run(body, d.problems[:2])
        assert_contained(trajs)
        assert all("budget exceeded" in t.error for t in trajs)
    finally:
        r.close()


def test_malformed_llm_request_is_reported_to_harness(runner):
    body = """
def run(env, llm):
    try:
        llm("not a list")
    except Exception as e:
        env.submit("refused: " + str(e)[:40])
"""
    trajs = play(runner, body)
    assert all(t.answer.startswith("refused: messages must be") for t in trajs)


def test_syntax_error_harness_scores_zero(runner):
    trajs = runner[0].run("def run(env, llm)\n    pass\n", runner[1].problems[:2])
    assert all("failed to load" in t.error for t in trajs)


def test_run_python_tool_is_sandboxed():
    assert run_python("print(6 * 7)").strip() == "42"
    assert "TimeoutError" in run_python("while True: pass", timeout_s=1)
    out = run_python("import os; print(sorted(os.environ))")
    assert "API_KEY" not in out


def test_uid_pool_ranges_are_disjoint_and_recycled(monkeypatch):
    """Processes sharing a node (the Ray driver and its actors) each hand out only their own uids."""
    from whale.rollout.sandbox import _UidPool

    monkeypatch.setattr(os, "getuid", lambda: 0)  # the pool only hands out uids when root
    a, b = _UidPool(), _UidPool()
    a.use_range(100, 102)
    b.use_range(102, 104)
    taken_a = [a.take(), a.take(), a.take()]
    taken_b = [b.take(), b.take()]
    assert taken_a == [100, 101, None]  # exhausted: the episode runs without its own uid
    assert taken_b == [102, 103]
    a.give(100)
    assert a.take() == 100
    with pytest.raises(ValueError, match="empty uid range"):
        a.use_range(5, 5)


def test_sandbox_processes_start_inside_their_cgroup():
    """Cgroup.command joins the process to every controller before it runs anything (no preexec_fn)."""
    cgroup = Cgroup.create(256 * 1024 * 1024, 16)
    if cgroup is None:
        pytest.skip("cgroups are not writable here")
    try:
        out = subprocess.run(cgroup.command(["cat", "/proc/self/cgroup"]), capture_output=True, text=True,
                             timeout=10).stdout
    finally:
        cgroup.remove()
    joined = [line for line in out.splitlines() if line.endswith("/" + cgroup.dirs[0].name)]
    assert len(joined) == len(cgroup.dirs), out  # memory and pids (cgroup v1), or the one v2 group
