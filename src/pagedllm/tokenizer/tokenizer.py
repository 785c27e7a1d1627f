"""Tokenizer built with the `tokenizers` package from GGUF metadata (tokenizer/gguf.py) or
tokenizer.json, chat templates rendered in jinja2's sandbox, and incremental detokenization
for streaming.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

import jinja2.meta
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from pagedllm.tokenizer.gguf import tokenizer_from_gguf
from pagedllm.errors import ModelLoadError

# encode_within: pieces of this many characters, each counted with this many tokens less
# (tokenizing pieces apart can split what the whole text would merge at their edges).
PIECE_CHARS, PIECE_EDGE_TOKENS = 16_384, 4
LONG_CHARS_PER_TOKEN = 8  # English prose is ~4 characters a token, code ~3


class TokenLimitError(ValueError):
    """A text has at least `num_tokens` tokens, over `limit` (it was not tokenized whole)."""

    def __init__(self, num_tokens: int, limit: int):
        self.num_tokens = num_tokens
        self.limit = limit
        super().__init__(f"the text has at least {num_tokens} tokens, over the limit of {limit}")


class ChatTemplateError(ValueError):
    """The chat template failed to render for these messages."""


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(self, tokenizer: HFTokenizer, *, bos_token_id: int | None, add_bos: bool,
                 eos_token_ids: Sequence[int], chat_template: str | None):
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = None
        self._template = None
        self.template_variables: frozenset[str] = frozenset()
        if chat_template:
            self.set_chat_template(chat_template)

    def set_chat_template(self, chat_template: str) -> None:
        """Render chats with this Jinja template instead (`serve --chat-template`); raises
        ChatTemplateError when it does not parse."""
        self._template, self.template_variables = compile_chat_template(chat_template)
        self.chat_template = chat_template

    def special_token_ids(self, texts) -> dict[str, int]:
        """Those of `texts` that are one special token of the vocabulary, with its id: a
        family's markers ([TOOL_CALLS], <|tool_call|>, [THINK]) that skip_special_tokens
        would drop from the text, and that a grammar must name as tokens."""
        return {text: self._special_ids[text] for text in texts if text in self._special_ids}

    @functools.cached_property
    def _special_ids(self) -> dict[str, int]:
        """Every special added token's text -> id (read once: chat requests ask each time)."""
        return {token.content: token_id
                for token_id, token in self._tok.get_added_tokens_decoder().items()
                if token.special}

    @functools.cached_property
    def added_token_texts(self) -> frozenset[str]:
        """The vocabulary's added tokens (<think>, <tool_call>, ...) as text."""
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values())

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, checkpoint) -> Tokenizer:
        source = checkpoint.tokenizer_source
        if "gguf" in source:
            return cls.from_gguf_metadata(checkpoint.path, source["gguf"])
        return cls.from_folder(source["folder"], checkpoint.config.eos_token_ids,
                               checkpoint.config.bos_token_id)

    @classmethod
    def from_model_path(cls, path: str | None) -> Tokenizer:
        """The tokenizer of a GGUF file or HF folder (None: the default model), read without
        loading the weights."""
        from pagedllm.weights import default_model_path
        from pagedllm.weights.gguf import read_gguf_header, tokenizer_metadata

        path = default_model_path() if path is None else path
        if os.path.isdir(path):
            return cls.from_folder(path)
        _, meta, _ = read_gguf_header(path)
        return cls.from_gguf_metadata(path, tokenizer_metadata(meta))

    @classmethod
    def for_served_model(cls, path: str, eos_token_ids=(), bos_token_id=None) -> Tokenizer:
        """The tokenizer a front end that holds no weights needs for a model an engine serves
        elsewhere (a replica, the engine process): a folder's with the model's own EOS and
        BOS ids, a GGUF file's from its header."""
        if os.path.isdir(path):
            return cls.from_folder(path, eos_token_ids, bos_token_id)
        return cls.from_model_path(path)

    @classmethod
    def from_gguf_metadata(cls, path: str, meta: dict) -> Tokenizer:
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [eos] if eos is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot not in eos_ids:
            eos_ids.append(eot)
        return cls(tokenizer_from_gguf(path, meta),
                   bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token",
                                         meta.get("tokenizer.ggml.model") == "llama")),
                   eos_token_ids=eos_ids, chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def from_folder(cls, folder: str, eos_token_ids=(), bos_token_id=None) -> Tokenizer:
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(folder, "folder has no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(path)
        except Exception as exc:  # noqa: BLE001 - the tokenizers error is a plain Exception
            raise ModelLoadError(path, f"not a readable tokenizer.json ({exc})") from exc
        config = {}
        config_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        eos_ids = list(eos_token_ids)
        eos_text = _token_text(config.get("eos_token"))
        if eos_text is not None and tok.token_to_id(eos_text) is not None:
            eos_id = tok.token_to_id(eos_text)
            if eos_id not in eos_ids:
                eos_ids.append(eos_id)
        bos_text = _token_text(config.get("bos_token"))
        if bos_text is not None and tok.token_to_id(bos_text) is not None:
            bos_token_id = tok.token_to_id(bos_text)
        # tokenizer.json's post-processor already adds BOS where the model wants it.
        return cls(tok, bos_token_id=bos_token_id, add_bos=False, eos_token_ids=eos_ids,
                   chat_template=template)

    # -- text <-> ids ---------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its text's length in the byte-level
        alphabet is its bytes, which bound its characters)."""
        return max(1, max(len(t) for t in self._tok.get_vocab(with_added_tokens=True)))

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) without encoding: a text too long for the
        context is refused in microseconds, not after seconds of tokenizing."""
        return len(text) // self.max_token_chars

    def encode_within(self, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
        """encode(), for a text that may hold at most `limit` tokens: one far past it is
        refused from min_tokens() without tokenizing, and a long one is tokenized in pieces
        that stop as soon as their count (less a margin for the pieces' edges) passes the
        limit, so refusing costs about what `limit` tokens cost. Near the limit it may return
        a few more than `limit` ids: the caller checks the exact length. Raises
        TokenLimitError."""
        at_least = self.min_tokens(text)
        if at_least > limit:
            raise TokenLimitError(at_least, limit)
        # Counting pieces costs a second pass over a text that fits: only for a text long for
        # its limit (over LONG_CHARS_PER_TOKEN characters a token), which rarely fits.
        if len(text) > max(PIECE_CHARS, LONG_CHARS_PER_TOKEN * limit):
            count, start = 0, 0
            while start < len(text):
                end = text.find(" ", start + PIECE_CHARS)  # cut at a space: words stay whole
                end = len(text) if end < 0 else end
                count += max(0, len(self.encode(text[start:end], False)) - PIECE_EDGE_TOKENS)
                if count > limit:
                    raise TokenLimitError(count, limit)
                start = end
        return self.encode(text, add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Raises ValueError for text that is not valid Unicode (a lone UTF-16 surrogate)."""
        try:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError as exc:  # tokenizers' message for text it cannot take as UTF-8
            raise ValueError("the text is not valid Unicode (it holds a lone UTF-16 "
                             "surrogate)") from exc
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for on its own (for logprobs)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    # -- chat -----------------------------------------------------------------------------
    @property
    def has_thinking_switch(self) -> bool:
        """Whether the chat template turns the model's thinking on and off (Qwen3's
        `enable_thinking`)."""
        return bool(self.chat_template) and "enable_thinking" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **options) -> str:
        """`tools`: OpenAI tool dicts, for templates that render them (Hugging Face's
        convention); templates that do not are given none (tool_calls/prompt.py). `options`:
        more variables the template reads (enable_thinking)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        bos = self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self._tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos, eos_token=eos, tools=tools, **options)
        except (TemplateError, TypeError) as exc:  # TypeError: a template adding None to text
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def new_detokenizer(self, prompt_token_ids: Sequence[int] = (),
                        skip_special_tokens: bool = True,
                        kept_special_token_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok, prompt_token_ids, skip_special_tokens,
                                      kept_special_token_ids)


# Every render passes these; a request's chat_template_kwargs may not set them.
RENDER_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                              "tools"})


def compile_chat_template(text: str):
    """(the sandboxed template, the variables a request's chat_template_kwargs may set: what
    it reads beyond what every render passes); ChatTemplateError when it does not parse."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    try:
        template = env.from_string(text)
        variables = jinja2.meta.find_undeclared_variables(env.parse(text))
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from exc
    return template, frozenset(variables - RENDER_VARIABLES - {"raise_exception"})


def _raise_template_error(message: str):
    raise TemplateError(message)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces; never emits half a UTF-8 character.

    Built on tokenizers' DecodeStream, which holds back bytes until they form whole
    characters. Seeding it with the prompt's tail makes the first token decode with the
    right leading space (SentencePiece strips it at the start of a text).
    """

    def __init__(self, tokenizer: HFTokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, kept_special_token_ids: Sequence[int] = ()):
        """kept_special_token_ids: special tokens written as their text all the same (a
        family's tool-call and thinking markers, which the answer's parsers read)."""
        self._tok = tokenizer
        self._kept = frozenset(kept_special_token_ids) if skip_special_tokens else frozenset()
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in list(prompt_token_ids)[-4:]:
            self._stream.step(tokenizer, token_id)

    def step(self, token_id: int) -> str:
        """Text newly completed by this token ('' while a character is still incomplete)."""
        if token_id in self._kept:  # the stream skips it, as it would any special token
            return self._tok.id_to_token(token_id) or ""
        return self._stream.step(self._tok, token_id) or ""
