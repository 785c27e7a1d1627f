"""A chat template given by an admin (`serve --chat-template`, a [models] entry's
`chat-template`): a file's text, or the template itself, checked to parse."""
from __future__ import annotations

import os

from pagedllm.tokenizer.tokenizer import ChatTemplateError, compile_chat_template

# Real chat templates are a few KB (Qwen3's ~4 KB, the longest GGUF ones ~40 KB).
MAX_TEMPLATE_BYTES = 1 << 20


def read_chat_template(given: str, base_dir: str = ".") -> str:
    """The template's text; ValueError (its message begins with what was given) for one
    that is neither a file nor a template, too large, not UTF-8, or does not parse. A
    relative file name is read from base_dir (a config file's folder)."""
    path = os.path.join(base_dir, os.path.expanduser(given))
    if os.path.isfile(path):
        size = os.path.getsize(path)
        if size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"{given}: {size:,} bytes; a chat template is at most "
                             f"{MAX_TEMPLATE_BYTES:,}")
        try:
            with open(path, encoding="utf-8") as f:
                given = f.read()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{given}: not UTF-8 text ({exc})") from exc
    elif "{{" not in given and "{%" not in given:
        raise ValueError(f"{given!r}: no such file, and not a Jinja template either (no "
                         f"{{{{ or {{% in it)")
    try:
        compile_chat_template(given)
    except ChatTemplateError as exc:
        raise ValueError(f"{exc}") from exc
    return given
