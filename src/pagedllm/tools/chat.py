"""`pagedllm chat`: an interactive terminal chat, against a server by URL or in-process."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import httpx

from pagedllm.core.request import SamplingParams


class ServerChat:
    """A running server's chat endpoint, checked once before the first message."""

    def __init__(self, url: str, api_key: str | None, max_tokens: int, temperature: float):
        self.base = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_tokens, self.temperature = max_tokens, temperature

    def connect(self) -> str:
        """The served model's name; RuntimeError when the server is unreachable or refuses
        the key (so the user hears it before typing anything)."""
        try:
            response = httpx.get(self.base + "/v1/models", headers=self.headers, timeout=10)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"cannot reach {self.base}: {exc}") from exc
        if response.status_code == 401:
            raise RuntimeError(f"{self.base} needs an API key: pass --api-key or set "
                               f"PAGEDLLM_API_KEY" if not self.headers else
                               f"{self.base} refused the API key")
        if response.status_code != 200:
            raise RuntimeError(f"{self.base}/v1/models answered {response.status_code}")
        return response.json()["data"][0]["id"]

    def stream(self, messages: list[dict]) -> Iterator[str]:
        body = {"messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "stream": True}
        with httpx.stream("POST", self.base + "/v1/chat/completions", json=body,
                          headers=self.headers, timeout=None) as response:
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


HISTORY_LINES = 1000


def line_editing(history_path: str | None):
    """Arrow keys, editing and the previous questions (up arrow) for input(), through
    Python's readline where this Python has it; the questions are kept in `history_path`
    (at most HISTORY_LINES) across sessions, written at exit. Returns that save function
    (None where there is no readline or no path)."""
    try:
        import readline
    except ImportError:  # some builds (Windows) have none: input() still works
        return None
    save = None
    if history_path:
        import atexit
        import os

        try:
            readline.read_history_file(history_path)
        except OSError:
            pass  # the first session: no file yet
        readline.set_history_length(HISTORY_LINES)

        def save():
            try:
                os.makedirs(os.path.dirname(history_path) or ".", exist_ok=True)
                readline.write_history_file(history_path)
            except OSError:
                pass  # a read-only home: history is a comfort, not a duty
        atexit.register(save)
    return save


def chat_loop(stream, system: str | None, read=input, write=sys.stdout.write,
              banner: str = "") -> int:
    """Read a line, stream the answer, repeat until EOF or /exit. Keeps the conversation;
    an answer cut short by Ctrl-C is shown but not kept (nor its question)."""
    messages = [{"role": "system", "content": system}] if system else []
    write(f"pagedllm chat with {banner}\n" if banner else "pagedllm chat\n")
    write("/exit or Ctrl-D to leave, /reset to start over, Ctrl-C stops an answer\n")
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
            write("(conversation cleared" + (", system prompt kept)\n" if system else ")\n"))
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
            write(" [interrupted: not kept in the conversation]\n")
            messages.pop()
            continue
        except RuntimeError as exc:
            write(f"error: {exc}\n")
            messages.pop()
            continue
        write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})
