"""The models a server can serve (`serve --models-dir DIR`, `[models]` in the config file):
each a name, a GGUF file or Hugging Face folder, and its own engine options; described
without loading it by serving/model_card.py. Which of them are loaded is serving/model_pool.py's business.

A model's LoRA adapters sit beside it in a folder named after it, `NAME.loras/` (each PEFT
folder or GGUF LoRA file in it an adapter, named by its folder or file name), or in its
[models] entry (`loras = ["sql=/path", ...]`). A request names an adapter as it names a
model; the adapter's base is loaded for it and serves it from its slots."""
from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass

from pagedllm.config import EngineConfig, LoRAConfig
from pagedllm.serving.model_card import ModelCard, describe, is_sentence_folder
from pagedllm.serving.store_adapters import adapters_beside, is_gguf_adapter, table_loras
from pagedllm.units import parse_bytes

LATEST = ":latest"  # Ollama's clients add the default tag to a bare name


class StoreError(ValueError):
    """A models folder or [models] entry that cannot be served (the message says why)."""


# What a [models] entry may set besides `path` and `aliases`: EngineConfig fields, each read
# as its command-line option would be.
def _memory(value):
    if isinstance(value, float) and 0 < value <= 1:
        return value
    return parse_bytes(str(value))


ENTRY_OPTIONS = {
    "max-model-len": ("max_model_len", int),
    "dtype": ("dtype", str),
    "kv-cache-memory": ("kv_cache_memory", _memory),
    "kv-cache-dtype": ("kv_cache_dtype", str),
    "max-num-seqs": ("max_num_seqs", lambda v: v if v == "auto" else int(v)),
    "speculative": (None, str),  # speculative.method; handled in engine_config
}


KINDS = ("chat", "embedding")


def _parser_choice(choices: tuple[str, ...]):
    def check(value):
        if value not in choices:
            raise ValueError(f"choose one of {', '.join(choices)}")
        return value
    return check


# What a [models] entry may set of how its chats are read (ServerConfig fields, in the
# server's settings' place for that model): its chat template (a file or the template) and
# the tool-call and reasoning parsers.
def _chat_options() -> dict:
    from pagedllm.reasoning.syntax import CHOICES as REASONING_PARSERS
    from pagedllm.tool_calls.syntax import CHOICES as TOOL_CALL_PARSERS

    return {"chat-template": "chat_template",
            "tool-call-parser": ("tool_call_parser", _parser_choice(TOOL_CALL_PARSERS)),
            "reasoning-parser": ("reasoning_parser", _parser_choice(REASONING_PARSERS))}


@dataclass(frozen=True)
class StoreEntry:
    name: str
    path: str
    options: tuple[tuple[str, object], ...] = ()  # EngineConfig field -> value
    aliases: tuple[str, ...] = ()
    kind: str = "chat"  # "embedding": served at /v1/embeddings and /api/embed
    pooling: str | None = None  # an embedding decoder's (embeddings/decoder_model.py)
    loras: tuple[tuple[str, str], ...] = ()  # its LoRA adapters: (name, path)
    # Its own chat settings in the server's place (ServerConfig field -> value): the chat
    # template's text, the tool-call and reasoning parsers.
    chat_settings: tuple[tuple[str, str], ...] = ()

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The server's engine settings with this model's file and own options (its
        adapters in the server's slots, --max-loras and --max-lora-rank)."""
        fields = dict(self.options)
        if self.loras:
            fields["lora"] = LoRAConfig(self.loras, True, base.lora.max_loras,
                                        base.lora.max_lora_rank)
        method = fields.pop("speculative", None)
        config = dataclasses.replace(base, model=self.path, **fields)
        if method is not None:
            config = dataclasses.replace(config, speculative=dataclasses.replace(
                config.speculative, method=method))
        return config


def scan_models_dir(folder: str) -> list[StoreEntry]:
    """Every servable model in a folder: each *.gguf file (named by its file name without
    .gguf) and each subfolder holding config.json and *.safetensors (named by the folder);
    a sentence-transformers folder (modules.json) is an embedding model."""
    if not os.path.isdir(folder):
        raise StoreError(f"--models-dir {folder}: no such folder")
    entries = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name.lower().endswith(".gguf"):
            if is_gguf_adapter(path):  # an adapter needs its base: NAME.loras/ says which
                continue
            entries.append(StoreEntry(name[:-len(".gguf")], os.path.abspath(path),
                                      loras=adapters_beside(folder, name[:-len(".gguf")])))
        elif os.path.isdir(path) and _is_hf_folder(path):
            kind = "embedding" if is_sentence_folder(path) else "chat"
            entries.append(StoreEntry(name, os.path.abspath(path), kind=kind,
                                      loras=adapters_beside(folder, name)))
    return entries


def _is_hf_folder(path: str) -> bool:
    files = os.listdir(path)
    return "config.json" in files and any(f.endswith(".safetensors") for f in files)


def entries_from_table(table: dict, source: str, base_dir: str = ".") -> list[StoreEntry]:
    """A config file's [models] table: `[models.NAME]` with path = FILE and optional aliases
    and engine options (`max-model-len = 2048`, `dtype = "float32"`, ...), or `NAME = PATH`."""
    entries = []
    for name, value in table.items():
        where = f"{source}: [models.{name}]"
        if isinstance(value, str):
            value = {"path": value}
        if not isinstance(value, dict) or not isinstance(value.get("path"), str):
            raise StoreError(f"{where} needs path = \"FILE.gguf or FOLDER\"")
        options, aliases, kind, pooling, loras, chat = [], (), "chat", None, (), []
        chat_options = _chat_options()
        for key, item in value.items():
            key = key.replace("_", "-")
            if key == "path":
                continue
            if key in chat_options:
                chat.append(_chat_setting(where, key, item, chat_options[key], base_dir))
                continue
            if key == "loras":
                loras = table_loras(item, base_dir)
                if loras is None:
                    raise StoreError(f'{where}: loras is a list of "NAME=PATH" or a table of '
                                     f'NAME = "PATH"')
                continue
            if key == "kind":
                if item not in KINDS:
                    raise StoreError(f"{where}: kind is one of {', '.join(KINDS)}")
                kind = item
            elif key == "pooling":
                if item not in ("last", "mean"):
                    raise StoreError(f"{where}: pooling is last or mean")
                pooling = item
            elif key == "aliases":
                if not (isinstance(item, list) and all(isinstance(a, str) for a in item)):
                    raise StoreError(f"{where}: aliases is a list of names")
                aliases = tuple(item)
            elif key in ENTRY_OPTIONS:
                field, convert = ENTRY_OPTIONS[key]
                try:
                    options.append((field or key, convert(item)))
                except (TypeError, ValueError) as exc:
                    raise StoreError(f"{where}: {key} = {item!r}: {exc}") from exc
            else:
                raise StoreError(f"{where}: unknown key {key!r}; known: path, aliases, kind, "
                                 f"pooling, loras, {', '.join(ENTRY_OPTIONS)}, "
                                 f"{', '.join(chat_options)}")
        path = os.path.abspath(os.path.join(base_dir, os.path.expanduser(value["path"])))
        if not os.path.exists(path):
            raise StoreError(f"{where}: no model at {path}")
        if is_sentence_folder(path):
            kind = "embedding"
        if pooling is not None and kind != "embedding":
            raise StoreError(f"{where}: pooling goes with kind = \"embedding\"")
        if chat and kind != "chat":
            raise StoreError(f"{where}: {chat[0][0].replace('_', '-')} goes with a model that "
                             f"generates text, not an embedding model")
        entries.append(StoreEntry(name, path, tuple(options), aliases, kind, pooling, loras,
                                  tuple(chat)))
    return entries


def _chat_setting(where: str, key: str, item, option, base_dir: str) -> tuple[str, str]:
    from pagedllm.tokenizer.template_source import read_chat_template

    if not isinstance(item, str):
        raise StoreError(f"{where}: {key} is text")
    try:
        if option == "chat_template":
            return option, read_chat_template(item, base_dir)
        field, check = option
        return field, check(item)
    except ValueError as exc:
        raise StoreError(f"{where}: {key} = {item[:80]!r}: {exc}") from exc


class ModelCatalog:
    """The store's entries by name; a name is found as given, without Ollama's `:latest`, or
    through an entry's aliases (and the server's --model-alias patterns, for the first)."""

    def __init__(self, entries: list[StoreEntry]):
        names = [e.name for e in entries]
        duplicate = {n for n in names if names.count(n) > 1}
        if duplicate:
            raise StoreError(f"two models are named {sorted(duplicate)[0]!r}: rename one file or "
                             f"[models] entry")
        if not entries:
            raise StoreError("the model store is empty: --models-dir has no *.gguf file or "
                             "Hugging Face folder, and the config file no [models] entry")
        self.entries = {e.name: e for e in entries}
        # Each adapter's base model, by the adapter's name (its own names must be new).
        self.adapters: dict[str, StoreEntry] = {}
        for entry in entries:
            for adapter, _ in entry.loras:
                if adapter in self.entries or adapter in self.adapters or any(
                        adapter in e.aliases for e in entries):
                    raise StoreError(f"the adapter {adapter!r} of {entry.name} has the name of "
                                     f"another model or adapter: rename its folder or file")
                self.adapters[adapter] = entry
        self._cards: dict[str, ModelCard] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def find(self, name: str) -> StoreEntry | None:
        """The model a name names; for an adapter's name, its base model (adapter_named)."""
        for candidate in (name, name.removesuffix(LATEST)):
            if candidate in self.entries:
                return self.entries[candidate]
            if candidate in self.adapters:
                return self.adapters[candidate]
        for entry in self.entries.values():
            if name in entry.aliases or name.removesuffix(LATEST) in entry.aliases:
                return entry
        return None

    def adapter_named(self, name: str) -> str | None:
        """The LoRA adapter a name names (Ollama's :latest too), or None."""
        return next((c for c in (name, name.removesuffix(LATEST)) if c in self.adapters), None)

    def card(self, name: str) -> ModelCard:
        """The entry's card, read once (slow: call off the event loop)."""
        with self._lock:
            card = self._cards.get(name)
        if card is None:
            card = describe(self.entries[name].path)
            with self._lock:
                self._cards[name] = card
        return card

