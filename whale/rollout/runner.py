"""The rollout runner: the one place where a rollout happens (training, search and evaluation).

It plays many episodes of one harness at once. Each episode is a sandboxed process forked from a
per-candidate fork server; its `llm(...)` and `env.<tool>(...)` calls arrive here over a pipe.
The parent runs an asyncio event loop:

- each model call goes to `Engine.submit` the moment it arrives and the episode awaits that call
  alone: batching is the engine's job (the hf engine lets a sequence join its running decode batch
  as soon as a row frees), so an episode's next call never waits for unrelated sequences, and the
  loop keeps serving sockets while the engine works in its own thread;
- tool calls run in a thread pool (retrieval, sandboxed Python), also off the loop;
- an episode's wall-time budget counts only the time the harness itself runs, not time queued for
  the engine or tools;
- everything the harness sends is schema-checked; what it is graded on is what the parent
  recorded (the `env` state), never what the harness claims;
- grading runs in worker processes (math-verify uses signal-based timeouts).

A harness that raises, hangs, exceeds a budget, exits or never submits gets reward 0 and an error
in its trajectory; the other episodes go on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable

from whale.config import Config
from whale.domains.base import Domain, EpisodeEnv, EpisodeError, Problem
from whale.engine.base import Engine, Generation, GenerationRequest, LockstepGate, SamplingParams
from whale.rollout.progress import ProgressBar
from whale.rollout.fork_server import SandboxHost, SpareForkServer
from whale.rollout.sandbox import UIDS
from whale.rollout.trajectory import LLMCall, ToolCall, Trajectory
from whale.rollout.usage import decide_usage, record_mark

ROLES = {"system", "user", "assistant", "tool"}
MAX_FORGED = 50  # unparseable or off-schema messages tolerated before the episode is killed


def exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """Grader-worker initializer: exit once the process that started the pool is gone.

    Why: a SIGKILLed run cannot shut its pool down, and a spawn worker holds both ends of its call
    queue, so it would wait forever (~300 MB each; a few dozen killed runs filled a 24 GiB machine)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="whale-grader-parent-watch").start()


def derive_seed(*parts: Any) -> int:
    """Seeds from (run, phase, step, problem, sample, call): stable across runs and batch-mates."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def sampling_from_config(cfg: Config) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(s.temperature, s.top_k, s.top_p, s.max_tokens, s.max_tokens_cap)


class RequestError(ValueError):
    """A malformed llm()/tool request from the harness; reported back to it, not fatal."""


def parse_llm_args(args: Any, cap: int) -> GenerationRequest:
    """Schema-check an `llm(...)` request coming from the sandbox."""
    if not isinstance(args, dict):
        raise RequestError("llm arguments must be an object")
    msgs = args.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list of {'role', 'content'} dicts")
    clean = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"bad message {str(m)[:80]!r}: needs role in {sorted(ROLES)}")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestError("message content must be a string")
        msg = {"role": m["role"], "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if key in m:
                msg[key] = m[key]
        clean.append(msg)
    max_tokens = args.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError("max_tokens must be a positive int")
    if max_tokens is not None:
        max_tokens = min(max_tokens, cap)
    stop = args.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8):
        raise RequestError("stop must be a string or a list of at most 8 non-empty strings")
    n = args.get("n", 1)
    if not isinstance(n, int) or not 1 <= n <= 16:
        raise RequestError("n must be an int in 1..16")
    choices = args.get("choices")
    if choices is not None:
        if (not isinstance(choices, list) or not choices or len(choices) > 512
                or not all(isinstance(c, str) and 0 < len(c) <= 200 for c in choices)):
            raise RequestError("choices must be a list of 1..512 non-empty strings (each <= 200 chars)")
    tools = args.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of OpenAI-style tool schemas (dicts)")
    tk = args.get("template_kwargs")
    if tk is not None and (not isinstance(tk, dict) or not all(isinstance(k, str) for k in tk)):
        raise RequestError("template_kwargs must be a dict with string keys")
    return GenerationRequest(messages=clean, max_tokens=max_tokens, stop=stop, n=n, choices=choices,
                             tools=tools, template_kwargs=tk)


def _grade_in_worker(grader: Callable, problem: Problem, answer: str | None) -> float:
    try:
        return float(grader(problem, answer))
    except Exception:
        return 0.0


class RolloutRunner:
    """Runs episodes of a harness against a domain and an engine. See the module docstring."""

    def __init__(self, engine: Engine, domain: Domain, cfg: Config):
        self.engine = engine
        self.domain = domain
        self.cfg = cfg
        self.sampling = sampling_from_config(cfg)
        self.budget = cfg.domain.budget
        self.tool_executor = ThreadPoolExecutor(8, thread_name_prefix="whale-tools")
        self._grader = domain.grader()  # picklable: runs in the grader processes
        self._grade_pool: ProcessPoolExecutor | None = None
        self._grade_lock = threading.Lock()
        # the next run's fork server, launched as each run ends (whale/rollout/fork_server.py)
        self.spare_fork_server: SpareForkServer | None = SpareForkServer()
        self.stats: dict[str, float] = {"episodes": 0, "llm_calls": 0, "lockstep_breaks": 0}
        self.last_lockstep_breaks: int | None = None  # see Executor.last_lockstep_breaks
        # called with every finished trajectory of every run (the run directory's in-flight journal)
        self.journal: Callable[[Trajectory], None] | None = None

    # ------------------------------------------------------------------ public API
    def run(self, harness_source: str, problems: list[Problem], samples: int = 1, *, harness_id: str = "h0",
            seed: int = 0, purpose: str = "eval", progress: str | None = None,
            on_episode: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Play `samples` episodes per problem; return graded trajectories in problem order."""
        if not problems or samples < 1:
            return []
        return asyncio.run(self._run(harness_source, problems, samples, harness_id, seed, purpose,
                                     progress, on_episode))

    def close(self) -> None:
        if self.spare_fork_server is not None:
            self.spare_fork_server.close()
        self.tool_executor.shutdown(wait=False)
        if self._grade_pool is not None:
            self._grade_pool.shutdown(wait=False, cancel_futures=True)
            self._grade_pool = None

    # ------------------------------------------------------------------ internals
    def _pool(self) -> ProcessPoolExecutor:
        with self._grade_lock:
            if self._grade_pool is None:
                self._grade_pool = ProcessPoolExecutor(
                    max(1, self.cfg.runner.grader_processes), mp_context=multiprocessing.get_context("spawn"),
                    initializer=exit_with_parent, initargs=(os.getpid(),))
            return self._grade_pool

    def _lockstep(self, purpose: str, clients: int) -> LockstepGate | None:
        mode = self.cfg.runner.lockstep
        if mode == "never" or (mode == "eval" and purpose != "eval"):
            return None
        return self.engine.lockstep(clients, self.cfg.runner.lockstep_hold_s)

    async def _run(self, source, problems, samples, harness_id, seed, purpose, progress, on_episode):
        slots = self.cfg.runner.concurrency
        host = SandboxHost(source, self.cfg.runner.sandbox, slots, self.spare_fork_server)
        await host.start()
        jobs = [(i, p, s) for i, p in enumerate(problems) for s in range(samples)]
        results: list[Trajectory | None] = [None] * len(jobs)
        bar = ProgressBar(progress, len(jobs))
        gate = self._lockstep(purpose, min(slots, len(jobs)))
        pending = iter(enumerate(jobs))  # shared by the slots: each takes the next job when it is free
        graded: list[asyncio.Future] = []

        async def finish(j: int, problem: Problem, traj: Trajectory) -> None:
            await self._grade_episode(problem, traj)
            results[j] = traj
            bar.advance(traj.reward)
            if on_episode is not None:
                on_episode(traj)
            if self.journal is not None:
                self.journal(traj)

        async def slot(w: int) -> None:
            """One episode slot. Under a lockstep it is client `w`, running from one episode straight
            into the next, and grading goes on beside it (the engine need not wait for a grader)."""
            try:
                for j, (idx, problem, sample) in pending:
                    def submit(req: GenerationRequest, j: int = j) -> Any:
                        if gate is None:
                            return self.engine.submit(req, self.sampling)
                        return gate.submit(w, j, req, self.sampling)

                    traj = await self._episode(host, problem, sample, harness_id, seed, purpose, idx, submit)
                    if gate is None:
                        await finish(j, problem, traj)
                    else:
                        graded.append(asyncio.ensure_future(finish(j, problem, traj)))
            finally:
                if gate is not None:
                    gate.leave(w)

        try:
            await asyncio.gather(*(slot(w) for w in range(min(slots, len(jobs)))))
            await asyncio.gather(*graded)
        finally:
            if gate is not None:
                gate.close()
                self.stats["lockstep_breaks"] += gate.breaks
            self.last_lockstep_breaks = None if gate is None else gate.breaks
            await host.close()
            bar.close()
        self.stats["episodes"] += len(jobs)
        if self.spare_fork_server is not None:
            self.spare_fork_server.launch(self.cfg.runner.sandbox, slots)
        return results  # type: ignore[return-value]

    async def _episode(self, host: SandboxHost, problem: Problem, sample: int, harness_id: str, seed: int,
                       purpose: str, index: int, submit: Callable[[GenerationRequest], Any]) -> Trajectory:
        """Play one episode (graded afterwards by `_grade_episode`)."""
        traj = Trajectory(problem_id=problem.id, sample=sample, harness_id=harness_id, source=problem.source,
                          question=problem.question, weights_version=self.engine.weights_version)
        if host.init_error:
            traj.error = f"harness failed to load: {host.init_error}"
            return traj
        env = self.domain.make_env(problem)
        episode = f"{purpose}-{index}-{sample}"
        uid = UIDS.take() if host.can_drop_privileges else None
        writer = None
        started = time.monotonic()
        try:
            reader, writer = await host.spawn(episode, uid, derive_seed(seed, problem.id, sample, "py"),
                                              env.public_state(), sorted(set(env.tools) | {"submit"}))
            traj.error = await self._serve(env, traj, reader, writer, host, episode,
                                           seed, problem, sample, started, submit)
        except Exception as exc:  # noqa: BLE001 - a runner bug must not kill the other episodes
            traj.error = f"runner error: {type(exc).__name__}: {exc}"
        finally:
            host.kill(episode)
            if writer is not None:
                writer.close()
            try:
                await asyncio.wait_for(asyncio.shield(host.exit_future(episode)), 5)
            except (asyncio.TimeoutError, KeyError):
                pass
            UIDS.give(uid)
            env.close()
        traj.answer = env.final_answer()
        traj.seconds = round(traj.seconds, 3)
        try:
            decide_usage(traj)  # which calls may be trained (usage.py)
        except Exception as exc:  # noqa: BLE001 - a bug there fails this episode, not the run
            traj.error = traj.error or f"runner error: deciding which calls are used: {type(exc).__name__}: {exc}"
        return traj

    async def _grade_episode(self, problem: Problem, traj: Trajectory) -> None:
        if traj.error is None and traj.answer is not None:
            traj.reward = await self._grade(problem, traj)
        elif traj.error is None:
            traj.error = "harness never submitted an answer"

    async def _grade(self, problem: Problem, traj: Trajectory) -> float:
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            try:
                return await loop.run_in_executor(self._pool(), _grade_in_worker, self._grader, problem, traj.answer)
            except Exception as exc:  # BrokenProcessPool (a grader crashed its process), pickling errors
                with self._grade_lock:
                    if self._grade_pool is not None:
                        self._grade_pool.shutdown(wait=False, cancel_futures=True)
                        self._grade_pool = None
                if attempt == 1:
                    traj.error = f"grading failed: {type(exc).__name__}: {exc}"
        return 0.0

    async def _llm(self, request: GenerationRequest, submit: Callable[[GenerationRequest], Any]) -> list[Generation]:
        """One model call: submitted as it arrives, awaited alone (the engine batches)."""
        self.stats["llm_calls"] += 1
        try:
            return await asyncio.wrap_future(submit(request))
        except Exception as exc:  # noqa: BLE001 - an engine bug fails this call, the episode goes on
            return [Generation(text=f"engine error: {type(exc).__name__}: {exc}", finish_reason="error")]

    async def _serve(self, env: EpisodeEnv, traj: Trajectory, reader, writer, host: SandboxHost, episode: str,
                     seed: int, problem: Problem, sample: int, started: float,
                     submit: Callable[[GenerationRequest], Any]) -> str | None:
        """Answer the episode's requests until it finishes; return its error (None if clean)."""
        budget = self.budget
        llm_calls = tool_calls = tokens = forged = 0
        exit_fut = host.exit_future(episode)

        async def reply(msg: dict) -> None:
            writer.write(json.dumps(msg).encode() + b"\n")
            await writer.drain()

        while True:
            remaining = budget.seconds - traj.seconds
            if remaining <= 0:
                return f"wall-time limit exceeded ({budget.seconds:g} s of harness time)"
            t0 = time.monotonic()
            read = asyncio.ensure_future(reader.readline())
            done, _ = await asyncio.wait({read, exit_fut}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            traj.seconds += time.monotonic() - t0
            if read not in done:
                if exit_fut in done and not read.done():
                    # the process is gone; give buffered output a moment to drain
                    try:
                        await asyncio.wait_for(read, 0.5)
                    except (asyncio.TimeoutError, ValueError, ConnectionError):
                        pass
                if not read.done():
                    read.cancel()
                    if exit_fut.done():
                        return _exit_reason(exit_fut.result())
                    return f"wall-time limit exceeded ({budget.seconds:g} s of harness time)"
            try:
                line = read.result()
            except (ValueError, asyncio.LimitOverrunError):
                return "harness sent an oversized message (> 2 MiB line)"
            except ConnectionError:
                line = b""
            if not line:
                status = await _wait_exit(exit_fut)
                return _exit_reason(status)
            try:
                msg = json.loads(line)
                if not isinstance(msg, dict):
                    raise ValueError
            except ValueError:
                forged += 1
                if forged > MAX_FORGED:
                    return "harness flooded the RPC pipe with malformed messages"
                continue
            op = msg.get("op")
            if op == "done":
                err = msg.get("error")
                traj.stdout_tail = str(msg.get("stdout", ""))[-2000:]
                return None if err is None else f"harness raised:\n{str(err)[-3000:]}"
            mid = msg.get("id")
            if not isinstance(mid, int):
                forged += 1
                if forged > MAX_FORGED:
                    return "harness flooded the RPC pipe with malformed messages"
                continue
            if op == "llm":
                if llm_calls >= budget.llm_calls:
                    await reply({"id": mid, "error": f"budget exceeded: more than {budget.llm_calls} llm calls", "fatal": True})
                    return f"budget exceeded: more than {budget.llm_calls} llm calls"
                try:
                    req = parse_llm_args(msg.get("args"), self.sampling.max_tokens_cap)
                except RequestError as e:
                    await reply({"id": mid, "error": str(e), "fatal": False})
                    continue
                req.seed = derive_seed(seed, problem.id, sample, llm_calls)
                llm_calls += 1
                gens = await self._llm(req, submit)
                outs = []
                for i, g in enumerate(gens):
                    tokens += g.prompt_tokens + g.completion_tokens
                    traj.prompt_tokens += g.prompt_tokens
                    traj.completion_tokens += g.completion_tokens
                    prefill = req.messages[-1]["content"] if req.messages[-1]["role"] == "assistant" else None
                    traj.calls.append(LLMCall(
                        messages=req.messages, completion=g.text, finish_reason=g.finish_reason,
                        prompt_ids=list(g.prompt_ids), completion_ids=list(g.completion_ids),
                        weights_version=g.weights_version, prefill=prefill, choices=req.choices,
                        tools=req.tools, tool_calls=g.tool_calls, template_kwargs=req.template_kwargs,
                        sample_index=i))
                    outs.append({"text": g.text, "finish_reason": g.finish_reason, "tool_calls": g.tool_calls,
                                 "usage": g.usage()})
                if tokens > budget.tokens:
                    await reply({"id": mid, "error": f"budget exceeded: {tokens} tokens > {budget.tokens}", "fatal": True})
                    return f"budget exceeded: {tokens} tokens > {budget.tokens}"
                if any(g.finish_reason == "error" for g in gens):
                    await reply({"id": mid, "error": f"engine error: {gens[0].text[:300]}", "fatal": False})
                    continue
                await reply({"id": mid, "ok": outs})
            elif op == "tool":
                name = msg.get("name")
                args, kwargs = msg.get("args", []), msg.get("kwargs", {})
                if name not in env.tools and name != "submit":
                    await reply({"id": mid, "error": f"env has no tool {name!r}", "fatal": False})
                    continue
                if not isinstance(args, list) or not isinstance(kwargs, dict):
                    await reply({"id": mid, "error": "tool args must be a list and kwargs an object", "fatal": False})
                    continue
                if name != "submit":
                    if tool_calls >= budget.tool_calls:
                        await reply({"id": mid, "error": f"budget exceeded: more than {budget.tool_calls} tool calls", "fatal": True})
                        return f"budget exceeded: more than {budget.tool_calls} tool calls"
                    tool_calls += 1
                t1 = time.monotonic()
                try:
                    result, text = await asyncio.get_running_loop().run_in_executor(
                        self.tool_executor, _call_tool, env, name, args, kwargs)
                    error = None
                except EpisodeError as e:
                    result, text, error = None, "null", str(e)
                except TypeError as e:
                    result, text, error = None, "null", f"bad arguments for env.{name}: {e}"
                except Exception as e:  # noqa: BLE001 - a tool bug is the episode's error, not the run's
                    result, text, error = None, "null", f"env.{name} failed: {type(e).__name__}: {e}"
                traj.tool_calls.append(ToolCall(name=name, args=args, kwargs=kwargs, result=_clip(result, text),
                                                error=error, seconds=round(time.monotonic() - t1, 4),
                                                after_calls=len(traj.calls)))
                if error is not None:
                    await reply({"id": mid, "error": error, "fatal": False, "state": env.public_state()})
                    if env.fatal_error:
                        return env.fatal_error
                else:
                    await reply({"id": mid, "ok": result, "state": env.public_state()})
            elif op == "mark":  # completion.use() / .discard(): whether a returned call is trained
                refused = record_mark(traj, msg.get("call"), msg.get("used"), msg.get("text"))
                await reply({"id": mid, "error": refused, "fatal": False} if refused else {"id": mid, "ok": True})
            else:
                forged += 1
                if forged > MAX_FORGED:
                    return "harness flooded the RPC pipe with malformed messages"


def _call_tool(env: EpisodeEnv, name: str, args: list, kwargs: dict) -> tuple[Any, str]:
    """Run one env tool; return its result and the result as JSON (it must cross the pipe)."""
    result = getattr(env, name)(*args, **kwargs)
    return result, json.dumps(result)


def _clip(value: Any, text: str, limit: int = 4000) -> Any:
    """The tool result as the trace keeps it: whole, or its JSON `text` cut to `limit` characters."""
    return value if len(text) <= limit else text[:limit] + "...[truncated]"


async def _wait_exit(fut: asyncio.Future) -> int | None:
    try:
        return await asyncio.wait_for(asyncio.shield(fut), 2)
    except asyncio.TimeoutError:
        return None


def _exit_reason(status: int | None) -> str:
    if status is None:
        return "harness process closed its channel without finishing"
    if status == -1:
        return "sandbox died"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        hint = " (CPU time limit)" if sig == signal.SIGXCPU else ""
        return f"harness process killed by {name}{hint}"
    return f"harness process exited with code {os.WEXITSTATUS(status)} before finishing"
