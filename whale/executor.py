"""Where rollouts run: in this process (`compute.executor: local`) or on Ray actors (`ray`).

An `Executor` is anything with `RolloutRunner.run`'s signature plus `close()`. The local executor
*is* `RolloutRunner` (it already satisfies the protocol), so there is one code path for an
episode: `RayExecutor` only spreads problems over `RunnerActor`s, each holding its own
`RolloutRunner`, and puts the results back in the local order.

What runs where (see docs/guides/scale-out.md):

- driver (this process): the engine object (an in-process hf model that training updates in
  place, or a vLLM client), the search/training loop, and a pump that answers engine calls;
- `EngineActor` (a Ray actor pinned to the driver node, no CPU): a mailbox. Workers' engine calls
  wait in it; the driver pump takes them, hands each one to `engine.submit` as it arrives, and
  posts each answer back the moment its future resolves (from the engine's thread), so one worker's
  call never waits for another's and the engine's own continuous batching sees every call at once.
  Why a mailbox and not the engine inside the actor: the hf engine is trained in place in the
  driver process, so only the driver has the current weights. The actor also holds the driver engine's `weights_version` (refreshed by every
  pump cycle and at the start of every run), which is what workers read;
- `RunnerActor`s (fractional CPUs, spread over nodes): a domain built from the config
  (`load_domain(cfg)`, or a picklable `domain_factory`), a `RolloutRunner`, sandboxes, graders.
  Their engine is an `EngineProxy` to the mailbox, or, when the driver engine is a vLLM client
  whose server all nodes can reach, a client of their own that talks to the server directly
  (`VLLMEngine.client_spec`; it follows the driver's `routing()`, adapter and version, at each run).

Seeds depend on (run seed, problem id, sample), never on which actor or batch an episode lands
in, so a deterministic engine gives exactly the trajectories of a local run. Ray is an optional
extra: `pip install 'whale-opt[ray]'`.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import sys
from concurrent.futures import Future
from typing import Any, Callable, Protocol
from urllib.parse import urlparse

from whale.config import Config, ConfigError
from whale.domains import Domain, Problem, load_domain
from whale.engine.base import Engine, Generation, GenerationRequest, Recovery, SamplingParams, error_generations, wait_all
from whale.engine.vllm import VLLMEngine
from whale.errors import MissingPackage, WorkerFailed
from whale.rollout.progress import ProgressBar
from whale.rollout.runner import RolloutRunner
from whale.rollout.sandbox import UID_BASE, UID_COUNT, UIDS
from whale.rollout.trajectory import Trajectory

RAY_HINT = "pip install 'whale-opt[ray]'"
LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


class Executor(Protocol):
    """Runs episodes: `RolloutRunner` (local) or `RayExecutor` (a Ray cluster)."""

    journal: Callable[[Trajectory], None] | None
    # after each run: None if it was not under a lockstep, else how many clients the engine stopped
    # waiting for (0: the batch is bit-reproducible; engine/lockstep.py)
    last_lockstep_breaks: int | None

    def run(self, harness_source: str, problems: list[Problem], samples: int = 1, *, harness_id: str = "h0",
            seed: int = 0, purpose: str = "eval", progress: str | None = None,
            on_episode: Callable[[Trajectory], None] | None = None) -> list[Trajectory]: ...

    def close(self) -> None: ...


def make_executor(cfg: Config, engine: Engine, domain: Domain,
                  domain_factory: Callable[[], Domain] | None = None) -> Executor:
    """The executor named by `cfg.compute.executor`.

    Ray workers cannot share `domain` (it may hold a large index), so they rebuild it with
    `domain_factory` (default: `load_domain(cfg)`); it must be picklable and importable there.
    """
    if cfg.compute.executor == "local":
        return RolloutRunner(engine, domain, cfg)
    if cfg.compute.executor == "ray":
        return RayExecutor(cfg, engine, domain_factory or functools.partial(load_domain, cfg))
    raise ConfigError(f"unknown compute.executor {cfg.compute.executor!r}: choose local or ray")


def import_ray():
    try:
        import ray  # optional extra: ray
    except ImportError:
        raise MissingPackage(f"compute.executor 'ray' needs Ray, which is not installed: {RAY_HINT}") from None
    return ray


# ---------------------------------------------------------------- actors (made remote lazily)
class EngineActor:
    """A mailbox (a Ray actor on the driver node): workers' engine calls wait here for the driver pump."""

    def __init__(self, weights_version: str, returns_ids: bool):
        self.weights_version = weights_version
        self.returns_ids = returns_ids
        self.calls: list[tuple[int, str, tuple]] = []  # (call id, method, args) not yet taken
        self.episodes: list[tuple[tuple[int, int], Trajectory]] = []  # ((run, shard), trajectory) not yet taken
        self.waiting: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.event: asyncio.Event | None = None

    def _wake(self) -> None:
        if self.event is None:
            self.event = asyncio.Event()
        self.event.set()

    async def call(self, method: str, args: tuple) -> tuple[bool, Any]:
        """A worker's engine call; returns (ok, result or error message) once the driver answered."""
        fut = asyncio.get_running_loop().create_future()
        self.next_id += 1
        self.waiting[self.next_id] = fut
        self.calls.append((self.next_id, method, args))
        self._wake()
        return await fut

    async def episode(self, shard: tuple[int, int], traj: Trajectory) -> None:
        self.episodes.append((shard, traj))
        self._wake()

    async def set_version(self, weights_version: str) -> None:
        self.weights_version = weights_version

    async def take(self, timeout_s: float, weights_version: str) -> tuple[list, list]:
        """The driver's side: wait up to `timeout_s` for work, then take all of it."""
        self.weights_version = weights_version
        if self.event is None:
            self.event = asyncio.Event()
        if not self.calls and not self.episodes and timeout_s > 0:
            try:
                await asyncio.wait_for(self.event.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        self.event.clear()
        calls, self.calls = self.calls, []
        episodes, self.episodes = self.episodes, []
        return calls, episodes

    async def answer(self, answers: list[tuple[int, bool, Any]]) -> None:
        for cid, ok, value in answers:
            fut = self.waiting.pop(cid, None)
            if fut is not None and not fut.done():
                fut.set_result((ok, value))

    async def info(self) -> tuple[str, bool]:
        return self.weights_version, self.returns_ids


class EngineProxy:
    """The `Engine` protocol inside a worker: every call goes through the EngineActor to the driver."""

    weight_sync = "none"  # workers never train: weights are pushed to the driver's engine
    recoveries: tuple[Recovery, ...] = ()  # the driver's engine recovers its server and logs it

    def __init__(self, mailbox: Any, returns_ids: bool):
        self.mailbox = mailbox
        self.returns_ids = returns_ids

    @property
    def weights_version(self) -> str:
        import ray  # optional extra: ray (this runs in a Ray actor, so it is installed)

        return ray.get(self.mailbox.info.remote())[0]

    def _call(self, method: str, *args: Any) -> Any:
        import ray  # optional extra: ray (this runs in a Ray actor, so it is installed)

        ok, value = ray.get(self.mailbox.call.remote(method, args))
        if not ok:  # raised here, not in the actor, so the message stays short (no remote traceback)
            raise RuntimeError(value)
        return value

    def submit(self, request: GenerationRequest, sampling: SamplingParams) -> Future[list[Generation]]:
        """Posts the call to the mailbox and returns at once; the future resolves when the driver answers."""
        answer = self.mailbox.call.remote("submit", (request, sampling)).future()
        result: Future[list[Generation]] = Future()

        def done(f: Future) -> None:
            try:
                ok, value = f.result()
            except Exception as e:  # noqa: BLE001 - the mailbox or the driver went away
                ok, value = False, f"{type(e).__name__}: {e}"
            result.set_result(value if ok else error_generations(f"engine error: {value}"))

        answer.add_done_callback(done)
        return result

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[list[Generation]]:
        return wait_all([self.submit(r, sampling) for r in requests])

    def lockstep(self, clients: int, hold_s: float = 1.0) -> None:
        """No deterministic batching: the driver batches calls from many machines by arrival."""
        return None

    def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        return self._call("count_tokens", messages)

    def load_weights(self, path: str | None, version: str) -> None:
        raise RuntimeError("weights are loaded into the driver's engine; workers follow its version")

    def close(self) -> None:
        pass


class RunnerActor:
    """A Ray actor with its own domain and RolloutRunner; plays the problems it is dealt."""

    def __init__(self, cfg: Config, domain_factory: Callable[[], Domain], mailbox: Any, returns_ids: bool,
                 client: dict[str, Any] | None, uid_slice: tuple[int, int]):
        UIDS.use_range(*uid_slice)
        self.mailbox = mailbox
        self.client = VLLMEngine(**client) if client is not None else None  # its own client of the server
        self.engine: Engine = self.client if self.client is not None else EngineProxy(mailbox, returns_ids)
        self.runner = RolloutRunner(self.engine, domain_factory(), cfg)

    def run(self, shard: tuple[int, int], harness_source: str, problems: list[Problem], samples: int, harness_id: str,
            seed: int, purpose: str, routing: dict[str, Any] | None) -> dict[str, Any]:
        if self.client is not None and routing is not None:  # where the driver's client sends requests now
            self.client.follow(routing)
        import ray  # optional extra: ray (this runs in a Ray actor, so it is installed)

        sent = []  # refs of streamed trajectories: all delivered before this call returns

        def stream(traj: Trajectory) -> None:
            sent.append(self.mailbox.episode.remote(shard, traj))

        calls = self.runner.stats["llm_calls"]
        trajs = self.runner.run(harness_source, problems, samples, harness_id=harness_id, seed=seed,
                                purpose=purpose, on_episode=stream)
        ray.get(sent)
        return {"trajectories": trajs, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "llm_calls": self.runner.stats["llm_calls"] - calls}

    def close(self) -> None:
        self.runner.close()
        if not isinstance(self.engine, EngineProxy):
            self.engine.close()


# ---------------------------------------------------------------- driver
class RayExecutor:
    """`RolloutRunner.run` on a Ray cluster; see the module docstring.

    Its workers' calls reach the driver's engine by arrival: never under a lockstep.

    `cfg.compute.ray_address` attaches to a running cluster (`ray start --head` on one machine,
    `ray start --address=HEAD:6379` on the others); empty starts a local one. `num_actors`
    defaults to the cluster's free CPUs (at most `cfg.runner.concurrency`); each actor asks for
    `cpus_per_actor` (fractional, so live actors never starve other Ray work of CPUs) and runs
    about `concurrency / num_actors` episodes at once. `runtime_env` is passed to `ray.init`;
    for a local cluster it defaults to this interpreter's sys.path as PYTHONPATH, so workers
    import what the driver imports.
    """

    def __init__(self, cfg: Config, engine: Engine, domain_factory: Callable[[], Domain] | None = None, *,
                 num_actors: int | None = None, cpus_per_actor: float = 0.5, num_cpus: int | None = None,
                 runtime_env: dict[str, Any] | None = None, poll_s: float = 0.05, ready_timeout_s: float = 600.0):
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # optional extra: ray

        if num_actors is not None and num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors}")
        if cpus_per_actor <= 0:
            raise ValueError(f"cpus_per_actor must be > 0, got {cpus_per_actor}")
        self.ray = ray
        self.cfg = cfg
        self.engine = engine
        self.domain_factory = domain_factory or functools.partial(load_domain, cfg)
        self.poll_s = poll_s
        self.journal: Callable[[Trajectory], None] | None = None
        self.stats: dict[str, Any] = {"llm_calls": 0, "episodes": 0, "engine_calls": 0}
        self.last_pids: list[int] = []  # which actor process played each trajectory of the last run
        self.runs = 0
        self.actors: list[Any] = []
        self.mailbox: Any = None
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            address = cfg.compute.ray_address or None
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            if address is None:
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray >= 2.5x turns token auth on by default
                kwargs["num_cpus"] = num_cpus
                if runtime_env is None:
                    paths = [p for p in sys.path if p and os.path.isdir(p)]
                    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}
            try:
                ray.init(address=address, runtime_env=runtime_env, **kwargs)
            except ConnectionError as e:
                raise ConfigError(f"compute.ray_address {address!r}: cannot reach a Ray cluster ({e}); "
                                  "start one with `ray start --head`") from None
        try:
            self._start_actors(num_actors, cpus_per_actor, NodeAffinitySchedulingStrategy, ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start_actors(self, num_actors, cpus_per_actor, node_affinity, ready_timeout_s) -> None:
        ray, cfg, engine = self.ray, self.cfg, self.engine
        here = ray.get_runtime_context().get_node_id()
        self.mailbox = ray.remote(EngineActor).options(
            num_cpus=0, scheduling_strategy=node_affinity(here, soft=False)
        ).remote(engine.weights_version, bool(engine.returns_ids))
        cpus = ray.available_resources().get("CPU", 1.0)
        n = num_actors or max(1, min(int(cpus), cfg.runner.concurrency))
        if n * cpus_per_actor > cpus + 1e-9:  # Ray would leave the extra actors pending forever
            raise ValueError(f"{n} rollout actors x {cpus_per_actor:g} CPUs do not fit the {cpus:g} free CPUs "
                             "of the Ray cluster; lower num_actors or cpus_per_actor")
        worker_cfg = cfg.model_copy(deep=True)
        worker_cfg.runner.concurrency = max(1, math.ceil(cfg.runner.concurrency / n))
        self.client = self._client_spec(ray)
        # disjoint uid ranges: slice 0 stays with this (driver) process, which runs sandboxes too
        per = UID_COUNT // (n + 1)
        UIDS.use_range(UID_BASE, UID_BASE + per)
        remote_worker = ray.remote(RunnerActor).options(num_cpus=cpus_per_actor, scheduling_strategy="SPREAD",
                                                        max_restarts=3)
        self.actors = [remote_worker.remote(worker_cfg, self.domain_factory, self.mailbox, bool(engine.returns_ids),
                                            self.client, (UID_BASE + (i + 1) * per, UID_BASE + (i + 2) * per))
                       for i in range(n)]
        # fail here, with the worker's own error, if a worker cannot build its domain or engine
        try:
            ray.get([a.__ray_ready__.remote() for a in self.actors], timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerFailed(f"the Ray rollout actors did not start within {ready_timeout_s:g} s") from None
        except ray.exceptions.RayActorError as e:
            raise WorkerFailed("a Ray rollout actor could not start (it builds the domain and engine from the "
                               "config; are whale and the data installed on every node?)", details=str(e)) from None

    def _client_spec(self, ray) -> dict[str, Any] | None:
        """Direct vLLM clients for the workers when the driver's engine is one and every node can
        reach its server, else None (the workers call the driver's engine through the mailbox)."""
        if not isinstance(self.engine, VLLMEngine):
            return None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if urlparse(self.engine.base_url).hostname in LOOPBACK and len(nodes) > 1:
            return None  # a server bound to 127.0.0.1 on the driver is out of other nodes' reach
        return self.engine.client_spec()

    def run(self, harness_source: str, problems: list[Problem], samples: int = 1, *, harness_id: str = "h0",
            seed: int = 0, purpose: str = "eval", progress: str | None = None,
            on_episode: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Same contract and result order as `RolloutRunner.run`; problems are dealt round-robin."""
        if not self.actors:
            raise RuntimeError("this RayExecutor is closed")
        if not problems or samples < 1:
            return []
        ray = self.ray
        self.runs += 1  # tags streamed episodes, so leftovers of an aborted run are never mixed in
        ray.get(self.mailbox.set_version.remote(self.engine.weights_version))  # before any episode starts
        routing = self.engine.routing() if isinstance(self.engine, VLLMEngine) and self.client else None
        shards = [list(range(i, len(problems), len(self.actors))) for i in range(min(len(self.actors), len(problems)))]
        refs = {self.actors[s].run.remote((self.runs, s), harness_source, [problems[i] for i in idx], samples,
                                          harness_id, seed, purpose, routing): s for s, idx in enumerate(shards)}
        bar = ProgressBar(progress, len(problems) * samples)
        outputs: dict[int, dict[str, Any]] = {}
        failures: list[str] = []
        pending = list(refs)
        try:
            while True:  # serve engine calls until every shard is back, even if one failed
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
                for ref in done:
                    try:
                        outputs[refs[ref]] = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - a dead actor, not an episode failure
                        failures.append(f"shard {refs[ref]}: {type(e).__name__}: {e}")
                calls, episodes = ray.get(self.mailbox.take.remote(self.poll_s if pending else 0,
                                                                   self.engine.weights_version))
                if calls:
                    self._serve(calls)
                for (run_no, _), traj in episodes:
                    if run_no != self.runs:
                        continue
                    bar.advance(traj.reward)
                    if on_episode is not None:
                        on_episode(traj)
                    if self.journal is not None:
                        self.journal(traj)
                if not pending and not calls and not episodes:
                    break
        finally:
            bar.close()
        if failures:
            first = " ".join(failures[0].split())[:200]
            raise WorkerFailed(f"{len(failures)} Ray rollout worker(s) died or failed (the actors restart for the "
                               f"next run; first: {first})", details="\n".join(f[:2000] for f in failures))
        results: list[Trajectory | None] = [None] * (len(problems) * samples)
        pids: list[int] = [0] * len(results)
        for s, idx in enumerate(shards):
            out = outputs[s]
            for j, traj in enumerate(out["trajectories"]):
                pos = idx[j // samples] * samples + j % samples
                results[pos], pids[pos] = traj, out["pid"]
            self.stats["llm_calls"] += out["llm_calls"]
        self.stats["episodes"] += len(results)
        self.last_pids = pids
        return results  # type: ignore[return-value]

    def _serve(self, calls: list[tuple[int, str, tuple]]) -> None:
        """Hand each worker call to the engine as it arrives; each answer is posted when it is ready."""
        answers: list[tuple[int, bool, Any]] = []
        for cid, method, args in calls:
            if method == "submit":
                self.stats["engine_calls"] += 1
                try:
                    future = self.engine.submit(*args)
                except Exception as e:  # noqa: BLE001 - reported to the calling worker
                    answers.append((cid, False, f"{type(e).__name__}: {e}"))
                    continue
                future.add_done_callback(functools.partial(self._post, cid))
            elif method == "count_tokens":
                try:
                    answers.append((cid, True, self.engine.count_tokens(*args)))
                except Exception as e:  # noqa: BLE001 - reported to the calling worker
                    answers.append((cid, False, f"{type(e).__name__}: {e}"))
            else:
                answers.append((cid, False, f"engine method {method!r} is not served to workers"))
        if answers:
            self.mailbox.answer.remote(answers)

    def _post(self, cid: int, future: Future) -> None:
        """Runs in the engine's thread when a call resolves (Ray calls are thread-safe)."""
        mailbox = self.mailbox
        if mailbox is None:
            return
        try:
            answer = (cid, True, future.result())
        except BaseException as e:  # noqa: BLE001 - a cancelled or broken future: the worker gets the error
            answer = (cid, False, f"{type(e).__name__}: {e}")
        mailbox.answer.remote([answer])

    def close(self) -> None:
        """Stop the actors; end this process's Ray session if this executor began it.

        With a `ray start` cluster that only disconnects; the cluster keeps running.
        """
        ray = self.ray
        for actor in self.actors:
            try:
                ray.get(actor.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead actor needs no closing
                pass
            ray.kill(actor)
        self.actors = []
        if self.mailbox is not None:
            ray.kill(self.mailbox)
            self.mailbox = None
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
        self.owns_ray = False
