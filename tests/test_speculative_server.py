"""`serve --speculative ngram` through the real server and the official clients: the same
answers as without, per-request choice, vLLM's counters on /metrics, the ready line, and
bad values refused by name."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from server_process import ServerProcess

QUOTE = ("Please repeat this sentence word for word: the committee will meet on Tuesday at "
         "nine in the large room on the second floor, and everyone should bring the report.")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("spec") / "server.log"
    proc = ServerProcess("--dtype", "bfloat16", "--kv-cache-memory", str(256 << 20),
                         "--speculative", "ngram", "--num-speculative-tokens", "4", "--served-model-name", "m",
                         log_path=str(log))
    yield proc
    proc.stop()


def counters(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("pagedllm:spec_decode") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def chat(client, **extra):
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUOTE}], temperature=0, max_tokens=60,
        **({"extra_body": extra} if extra else {}))
    return answer.choices[0].message.content


def test_same_answers_and_counters_move(spec_server):
    from openai import OpenAI

    client = OpenAI(base_url=spec_server.url + "/v1", api_key="none")
    before = counters(spec_server)
    fast = chat(client)
    after = counters(spec_server)
    plain = chat(client, speculative="off")
    assert fast == plain and len(fast) > 20
    name = next(k for k in after if k.startswith("pagedllm:spec_decode_num_drafts_total"))
    assert after[name] > before.get(name, 0)
    accepted = next(k for k in after if k.startswith("pagedllm:spec_decode_num_accepted_tokens_total"))
    proposed = next(k for k in after if k.startswith("pagedllm:spec_decode_num_draft_tokens_total"))
    assert 0 < after[accepted] <= after[proposed]
    assert any(k.startswith("pagedllm:spec_decode_num_accepted_tokens_per_pos_total")
               and 'position="0"' in k for k in after)
    # "off" for the request: the counters stay.
    assert counters(spec_server)[name] == after[name]
    # The Ollama API takes it among its options.
    reply = httpx.post(spec_server.url + "/api/chat", json={
        "model": "m", "stream": False, "messages": [{"role": "user", "content": QUOTE}],
        "options": {"temperature": 0, "num_predict": 60, "speculative": "off"}}, timeout=60)
    assert reply.status_code == 200 and reply.json()["message"]["content"] == plain


def test_the_ready_line_says_so(spec_server):
    assert "speculative decoding: ngram, up to 4 proposed tokens a step" in spec_server.output()


def test_bad_values_are_refused_by_name(spec_server):
    reply = httpx.post(spec_server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "speculative": "eagle"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "speculative"
    reply = httpx.post(spec_server.url + "/api/generate", json={
        "model": "m", "prompt": "hi", "stream": False, "options": {"speculative": 3}})
    assert reply.status_code == 400 and "speculative" in reply.text


def test_serve_refuses_too_many_speculative_tokens():
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--speculative", "ngram",
                           "--num-speculative-tokens", "17", "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "num_speculative_tokens must be 1-16" in done.stderr


def test_bench_grounded_load_reports_acceptance(spec_server, tmp_path):
    import json

    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "--base-url", spec_server.url,
                          "--concurrency", "1", "--requests", "2", "--prompt-tokens", "60:80",
                          "--max-tokens", "24", "--load", "grounded", "--warmup", "0",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["settings"]["load"] == "grounded"
    (level,) = data["levels"]
    spec = level["speculative"]
    assert spec["draft_tokens"] >= spec["accepted_tokens"] > 0 and spec["drafts"] > 0
    assert spec["acceptance_rate"] == round(spec["accepted_tokens"] / spec["draft_tokens"], 4)
    assert level["mean_prompt_tokens"] > 60  # the passage and the instruction around it


def test_grounded_prompts_ask_to_repeat_their_passage():
    from pagedllm.tokenizer import Tokenizer
    from pagedllm.tools.text_prompts import GROUNDED_INSTRUCTION, grounded_prompt_token_ids

    tokenizer = Tokenizer.from_model_path(None)
    prompts = grounded_prompt_token_ids(tokenizer, [50, 120], seed=3)
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    assert all(GROUNDED_INSTRUCTION in t and t.startswith("<|im_start|>") for t in texts)
    assert 50 < len(prompts[0]) < len(prompts[1])
    assert grounded_prompt_token_ids(tokenizer, [50, 120], seed=3) == prompts


def test_live_view_carries_the_acceptance(spec_server):
    from openai import OpenAI

    chat(OpenAI(base_url=spec_server.url + "/v1", api_key="none"))
    stats = httpx.get(spec_server.url + "/v1/server/state").json()["stats"]
    assert stats["spec_num_draft_tokens"] >= stats["spec_num_accepted_tokens"] > 0
    assert stats["spec_num_drafts"] > 0


def test_serve_with_a_draft_model(tmp_path):
    from openai import OpenAI

    from pagedllm.weights import default_model_path

    draft = default_model_path()  # the served model drafting for itself: it is what is shipped
    proc = ServerProcess("--dtype", "bfloat16", "--kv-cache-memory", str(128 << 20),
                         "--speculative", "draft", "--draft-model", draft,
                         "--served-model-name", "m", log_path=str(tmp_path / "server.log"))
    try:
        assert f"speculative decoding: draft model {draft}, up to 5" in proc.output()
        client = OpenAI(base_url=proc.url + "/v1", api_key="none")
        fast = chat(client)
        assert chat(client, speculative="off") == fast
        assert chat(client, speculative="ngram") == fast
        name = next(k for k in counters(proc)
                    if k.startswith("pagedllm:spec_decode_num_accepted_tokens_total"))
        assert counters(proc)[name] > 0
    finally:
        proc.stop()


def test_a_request_asking_for_a_draft_model_the_server_lacks_is_refused(spec_server):
    reply = httpx.post(spec_server.url + "/v1/completions", json={
        "prompt": "hi", "max_tokens": 4, "speculative": "draft"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "speculative" and "no draft model" in error["message"]
