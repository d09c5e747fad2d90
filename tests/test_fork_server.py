"""The fork server of a run is launched ahead of it (whale/rollout/fork_server.py): the next run
adopts a process that was started but never played an episode; anything that does not fit is
killed, never used."""

import threading

from toy import H0, ScriptedEngine, ToyDomain
from whale.config import Config, SandboxConfig
from whale.rollout import fork_server
from whale.rollout.fork_server import SpareForkServer
from whale.rollout.runner import RolloutRunner

GOOD = H0.replace('"{question}"', '"Answer correctly: {question}"')  # the scripted engine answers it right


def dead(process) -> bool:
    return process.proc.poll() is not None


def test_each_run_adopts_the_fork_server_launched_as_the_previous_run_ended(monkeypatch):
    cfg = Config()
    cfg.runner.concurrency = 2
    domain = ToyDomain(4)
    runner = RolloutRunner(ScriptedEngine(), domain, cfg)
    adopted = []
    start = fork_server.SandboxHost.start

    async def recording_start(host):
        await start(host)
        adopted.append(host.process)

    monkeypatch.setattr(fork_server.SandboxHost, "start", recording_start)
    try:
        assert [t.reward for t in runner.run(GOOD, domain.problems)] == [1.0] * 4
        spare = runner.spare_fork_server._spare
        assert spare is not None and not dead(spare)
        assert spare is not adopted[0] and dead(adopted[0])  # never the process that played episodes

        assert [t.reward for t in runner.run(GOOD, domain.problems)] == [1.0] * 4
        assert adopted[1] is spare and dead(spare)  # adopted, and killed with its run
        following = runner.spare_fork_server._spare
        assert following is not None and following is not spare and not dead(following)
    finally:
        runner.close()
    assert dead(following) and runner.spare_fork_server._spare is None


def test_a_spare_that_does_not_fit_the_run_is_killed_and_replaced():
    cfg = SandboxConfig(memory_mb=256)
    spares = SpareForkServer()
    try:
        spares.launch(cfg, 4)
        first = spares._spare
        other = spares.take(SandboxConfig(memory_mb=512), 4)  # other sandbox settings
        assert other is not first and dead(first) and not dead(other)
        other.kill()

        spares.launch(cfg, 4)
        second = spares._spare
        third = spares.take(cfg, 8)  # other number of slots (its cgroup's limits)
        assert third is not second and dead(second)
        third.kill()

        spares.launch(cfg, 4)
        exited = spares._spare
        exited.kill()
        fresh = spares.take(cfg, 4)  # a spare that died meanwhile
        assert fresh is not exited and not dead(fresh)
        fresh.kill()
    finally:
        spares.close()


def test_a_spare_launched_by_another_thread_is_not_adopted():
    """bubblewrap's --die-with-parent ends a sandbox with the thread that launched it, so a run may
    only adopt a spare its own thread launched."""
    cfg = SandboxConfig()
    spares = SpareForkServer()
    try:
        launcher = threading.Thread(target=spares.launch, args=(cfg, 2))
        launcher.start()
        launcher.join()
        foreign = spares._spare
        assert foreign is not None
        mine = spares.take(cfg, 2)
        assert mine is not foreign and dead(foreign) and not dead(mine)
        mine.kill()
    finally:
        spares.close()


def test_close_kills_the_spare():
    spares = SpareForkServer()
    spares.launch(SandboxConfig(), 2)
    spare = spares._spare
    spares.close()
    assert dead(spare) and spares._spare is None
