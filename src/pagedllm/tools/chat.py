"""`pagedllm chat`: an interactive terminal chat, against a server by URL or in-process."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import httpx

from pagedllm.core.request import SamplingParams


def stream_from_server(url: str, messages: list[dict], max_tokens: int, temperature: float,
                       api_key: str | None = None) -> Iterator[str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "stream": True}
    with httpx.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers,
                      timeout=None) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"server answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    yield piece


def stream_in_process(engine, messages: list[dict], max_tokens: int, temperature: float) -> Iterator[str]:
    prompt = engine.tokenizer.apply_chat_template(messages)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    request = engine.add_request(None, ids, SamplingParams(max_tokens=max_tokens, temperature=temperature))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request.request_id and out.new_text:
                yield out.new_text


def chat_loop(stream, system: str | None, read=input, write=sys.stdout.write) -> int:
    """Read a line, stream the answer, repeat until EOF or /exit. Keeps the conversation."""
    messages = [{"role": "system", "content": system}] if system else []
    write("pagedllm chat — /exit or Ctrl-D to leave, /reset to start over\n")
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        answer = []
        try:
            for piece in stream(messages):
                answer.append(piece)
                write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            write(" [interrupted]")
        except RuntimeError as exc:
            write(f"error: {exc}\n")
            messages.pop()
            continue
        write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})
