"""A sentence-transformers model folder as it describes itself: modules.json names the
encoder, its pooling (1_Pooling/config.json: mean, CLS, max or mean with sqrt length) and
whether vectors are normalised; sentence_bert_config.json the longest input; tokenizer.json
the tokenizer (the `tokenizers` library). embed() gives what SentenceTransformer.encode
gives for the same texts (tests/test_embeddings.py checks it against the package).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.embeddings.bert import BertEncoder
from pagedllm.errors import ModelLoadError

POOLING_MODES = ("mean_tokens", "cls_token", "max_tokens", "mean_sqrt_len_tokens")
# Inputs run per forward pass: longest first, so each pass pads to lengths close together.
BATCH_INPUTS = 32


@dataclass(frozen=True)
class Pooling:
    mode: str  # one of POOLING_MODES
    normalize: bool


def _read_json(folder: str, name: str) -> dict | list | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(folder, f"{name} is not readable JSON ({exc})") from exc


def read_pooling(folder: str) -> Pooling:
    """The pooling and normalisation modules.json lists (none listed: mean, no normalising)."""
    modules = _read_json(folder, "modules.json") or []
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    mode = "mean_tokens"
    if "Pooling" in kinds:
        config = _read_json(os.path.join(folder, kinds["Pooling"].get("path", "")), "config.json") or {}
        chosen = [m for m in POOLING_MODES if config.get(f"pooling_mode_{m}")]
        unknown = [k for k, v in config.items() if k.startswith("pooling_mode_") and v
                   and k.removeprefix("pooling_mode_") not in POOLING_MODES]
        if unknown or len(chosen) != 1:
            raise ModelLoadError(folder, f"pooling {unknown or chosen}: one of "
                                         f"{', '.join(POOLING_MODES)} is supported")
        mode = chosen[0]
    extra = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if extra:
        raise ModelLoadError(folder, f"modules.json lists {', '.join(sorted(extra))}, which is "
                                     "not supported (Transformer, Pooling, Normalize are)")
    return Pooling(mode, "Normalize" in kinds)


EMBEDDING_DTYPES = ("auto", "float32", "bfloat16")


def resolve_dtype(dtype: str) -> str:
    if dtype not in EMBEDDING_DTYPES:
        raise ValueError(f"embedding dtype must be one of {', '.join(EMBEDDING_DTYPES)}, "
                         f"got {dtype!r}")
    if dtype != "auto":
        return dtype
    from pagedllm.kernels.cpu import detect

    return "bfloat16" if detect().native_bf16 else "float32"


class SentenceModel:
    """Texts or token ids -> one vector each, as the folder's sentence-transformers
    modules would make it."""

    def __init__(self, folder: str, name: str | None = None, dtype: str = "auto"):
        """dtype: the encoder's matrix products: float32, bfloat16, or auto (bfloat16 where
        the CPU level in use multiplies bf16 natively, else float32; bert.py says what it
        trades)."""
        from tokenizers import Tokenizer

        self.folder = folder
        self.name = name or os.path.basename(os.path.normpath(folder))
        self.dtype = resolve_dtype(dtype)
        self.encoder = BertEncoder.from_folder(folder, getattr(torch, self.dtype))
        self.pooling = read_pooling(folder)
        st_config = _read_json(folder, "sentence_bert_config.json") or {}
        self.max_tokens = min(int(st_config.get("max_seq_length") or self.encoder.config.max_positions),
                              self.encoder.config.max_positions)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(folder, "no tokenizer.json")
        # Two tokenizers, configured once each (their settings are shared state): one that
        # counts the whole input, one that cuts it to max_tokens (Ollama's `truncate`).
        self._whole = Tokenizer.from_file(path)
        self._whole.no_truncation()
        self._whole.no_padding()
        self._cut = Tokenizer.from_file(path)
        self._cut.enable_truncation(self.max_tokens)
        self._cut.no_padding()

    @property
    def dimensions(self) -> int:
        return self.encoder.config.hidden_size

    @property
    def parameters(self) -> int:
        return sum(t.numel() for t in self.encoder.w.values())

    @property
    def vocab_size(self) -> int:
        return self.encoder.config.vocab_size

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Each text's ids, special tokens included ([CLS] ... [SEP]); cut to max_tokens
        when `truncate`, else whole (the caller refuses the ones too long)."""
        tokenizer = self._cut if truncate else self._whole
        return [encoding.ids for encoding in tokenizer.encode_batch(texts)]

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """Token id lists (each 1..max_tokens long) -> [len(inputs), dimensions] float32."""
        out = torch.empty(len(inputs), self.dimensions)
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        for start in range(0, len(order), BATCH_INPUTS):
            chunk = order[start:start + BATCH_INPUTS]
            length = len(inputs[chunk[0]])
            ids = torch.zeros(len(chunk), length, dtype=torch.long)
            mask = torch.zeros(len(chunk), length, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, :len(inputs[i])] = torch.tensor(inputs[i])
                mask[row, :len(inputs[i])] = 1
            out[chunk] = self._pool(self.encoder(ids, mask), mask)
        return out

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mode, weights = self.pooling.mode, mask.unsqueeze(-1).to(hidden.dtype)
        if mode == "cls_token":
            pooled = hidden[:, 0]
        elif mode == "max_tokens":
            pooled = hidden.masked_fill(weights == 0, -1e9).max(dim=1).values
        else:
            total, count = (hidden * weights).sum(dim=1), weights.sum(dim=1).clamp(min=1e-9)
            pooled = total / (count if mode == "mean_tokens" else count.sqrt())
        return F.normalize(pooled, p=2, dim=1) if self.pooling.normalize else pooled
