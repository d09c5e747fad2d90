"""`choices` draws: one `draw_choices` for every backend, so the same seed and the same
log-probabilities pick the same choice on hf, vllm and openai."""

from __future__ import annotations

import json
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fake_vllm import FakeVLLM

from whale.engine.base import GenerationRequest, SamplingParams, draw_choices
from whale.engine.hf import HFEngine
from whale.engine.openai import OpenAIEngine
from whale.engine.vllm import VLLMEngine

HOT = SamplingParams(temperature=4.0)  # hot enough that 24 seeds draw more than one choice


class ScoringServer:
    """An OpenAI-format /v1/completions that scores `prompt + choice` by echo: the choice's text
    costs `scores[choice]` (one logged token at its offset), the prompt nothing."""

    def __init__(self, scores: dict[str, float]):
        self.scores = scores
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
                choice = max((c for c in server.scores if prompt.endswith(c)), key=len)
                answer = {"choices": [{"text": prompt, "logprobs": {
                    "text_offset": [0, len(prompt) - len(choice)], "tokens": ["p", choice],
                    "token_logprobs": [None, server.scores[choice]]}}]}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _openai_picks(scores: dict[str, float], tiny_model_dir, messages, seed: int, n: int) -> list[str]:
    server = ScoringServer(scores)
    try:
        eng = OpenAIEngine(server.url, "m", timeout_s=10, tokenizer_path=str(tiny_model_dir))
        [gens] = eng.generate([GenerationRequest(messages, choices=list(scores), n=n, seed=seed)], HOT)
    finally:
        server.close()
    assert all(g.finish_reason == "choice" for g in gens), gens[0].text
    return [g.text for g in gens]


def test_draw_choices_is_the_inverse_cdf_of_a_seeded_uniform():
    logps = [-1.0, -3.5, -0.2, -2.0]
    picks = draw_choices(logps, list(range(200)), 2.0)
    assert set(picks) == {0, 1, 2, 3} and picks == draw_choices(logps, list(range(200)), 2.0)
    weights = [math.exp(x / 2.0 + 0.1) for x in logps]  # softmax(logp / T) up to its sum; -0.2 is the top
    assert picks == [random.Random(s).choices(range(4), weights)[0] for s in range(200)]
    assert draw_choices(logps, [5, 6], 0.0) == [2, 2]  # T = 0: the best
    assert draw_choices([-1.0, -1.0], [0], 0.0) == [0]  # ties: the first


def test_the_same_seed_picks_the_same_choice_on_every_backend(tiny_model_dir):
    """hf scores choices with its model; the openai backend, served those same log-probs, and the
    vllm backend, whose fake server gives its own, pick what `draw_choices` picks from them."""
    messages = [{"role": "user", "content": "Which city?"}]
    choices = ["Paris", "Nairobi", "e2e4", "Lima"]
    hf = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=128)
    try:
        [gens] = hf.generate([GenerationRequest(messages, choices=choices, n=24, seed=3)], HOT)
        logps = hf.choice_logprobs(gens[0].prompt_ids, choices).tolist()
    finally:
        hf.close()
    hf_picks = [g.text for g in gens]
    assert len(set(hf_picks)) > 1  # a draw, not an argmax
    assert hf_picks == [choices[i] for i in draw_choices(logps, [3 + i for i in range(24)], HOT.temperature)]
    assert _openai_picks(dict(zip(choices, logps)), tiny_model_dir, messages, seed=3, n=24) == hf_picks

    fake = FakeVLLM().serve_in_thread()
    try:
        eng = VLLMEngine("m", base_url=fake.url)
        vllm_choices = ["ab", "ac", "b", "ca"]
        [gens] = eng.generate([GenerationRequest(messages, choices=vllm_choices, n=24, seed=8)], HOT)
        vllm_logps = eng.choice_logprobs(gens[0].prompt_ids, vllm_choices)
        eng.close()
    finally:
        fake.close()
    vllm_picks = [g.text for g in gens]
    assert len(set(vllm_picks)) > 1
    assert _openai_picks(dict(zip(vllm_choices, vllm_logps)), tiny_model_dir, messages, seed=8, n=24) == vllm_picks


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_hf_choices_follow_draw_choices_at_any_temperature(tiny_model_dir, temperature):
    messages = [{"role": "user", "content": "Pick one."}]
    choices = ["yes", "no", "maybe"]
    hf = HFEngine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=128)
    try:
        [gens] = hf.generate([GenerationRequest(messages, choices=choices, n=8, seed=11)],
                             SamplingParams(temperature=temperature))
        logps = hf.choice_logprobs(gens[0].prompt_ids, choices).tolist()
    finally:
        hf.close()
    assert [g.text for g in gens] == [choices[i] for i in draw_choices(logps, list(range(11, 19)), temperature)]
