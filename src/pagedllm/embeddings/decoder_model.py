"""A decoder model (a GGUF file or Hugging Face folder of a Llama-family model) as an
embedding model, as llama.cpp's `--embedding --pooling` and vLLM's pooling runner do: each
input is prefilled through the model (its own small paged KV cache, made for the pass and
dropped after), the final hidden states (after the last norm) are pooled (the last token's,
or the mean over the input's tokens) and L2-normalised.

The pooling comes from `--pooling`, else from the GGUF's `{arch}.pooling_type` (what
embedding models converted by llama.cpp carry), else the last token (vLLM's default for
decoder embedding models). Runs in float32: vectors are compared, so they are exact.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pagedllm.attention import AttentionMetadata, allocate_layer_caches
from pagedllm.errors import ModelLoadError

DECODER_POOLINGS = ("last", "mean")
# llama.cpp's enum llama_pooling_type, as GGUF files store it.
GGUF_POOLING = {1: "mean", 3: "last"}
BLOCK_SIZE = 16
MAX_PASS_TOKENS = 4096  # tokens prefilled in one forward pass (inputs split between passes)
MAX_EMBED_TOKENS = 8192  # longest input, whatever the model's context


def gguf_pooling(path: str) -> str | None:
    """The pooling a GGUF embedding model declares, or None."""
    if not os.path.isfile(path):
        return None
    from pagedllm.weights.gguf import read_gguf_header

    _, meta, config = read_gguf_header(path)
    value = meta.get(f"{config.architecture}.pooling_type")
    try:
        return GGUF_POOLING.get(int(value)) if value is not None else None
    except (TypeError, ValueError):
        return None


class DecoderEmbeddingModel:
    """Texts or token ids -> one vector each, from a decoder's final hidden states."""

    def __init__(self, path: str, pooling: str | None = None, name: str | None = None):
        from pagedllm.backends import choose_backend
        from pagedllm.models.build import build_model
        from pagedllm.tokenizer import Tokenizer
        from pagedllm.weights import load_checkpoint

        if pooling is not None and pooling not in DECODER_POOLINGS:
            raise ModelLoadError(path, f"pooling {pooling!r}: one of {', '.join(DECODER_POOLINGS)}")
        self.folder = path
        self.dtype = "float32"
        base = os.path.basename(os.path.normpath(path))
        self.name = name or (base[:-len(".gguf")] if base.lower().endswith(".gguf") else base)
        self.pooling_mode = pooling or gguf_pooling(path) or "last"
        checkpoint = load_checkpoint(path)
        self.config = checkpoint.config
        if self.config.sliding_window is not None:
            raise ModelLoadError(path, "a model with sliding-window layers is not served as "
                                       "an embedding model yet")
        self.tokenizer = Tokenizer.from_checkpoint(checkpoint)
        self.net = build_model(self.config, checkpoint.weights, checkpoint.quantized,
                               torch.float32, choose_backend("cpu"), int8_activations=False)
        self._parameters = sum(t.numel() for t in checkpoint.weights.values())
        del checkpoint
        self.max_tokens = min(self.config.max_position_embeddings, MAX_EMBED_TOKENS)

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    @property
    def parameters(self) -> int:
        return self._parameters

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Each text's ids as the model's tokenizer gives them (its BOS where it adds one);
        cut to max_tokens when `truncate`."""
        ids = [self.tokenizer.encode(text) for text in texts]
        return [i[:self.max_tokens] for i in ids] if truncate else ids

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """Token id lists (each 1..max_tokens long) -> [len(inputs), dimensions] float32,
        as few forward passes as MAX_PASS_TOKENS allows."""
        out = torch.empty(len(inputs), self.dimensions)
        batch: list[int] = []
        for i in range(len(inputs)):
            if batch and sum(len(inputs[j]) for j in batch) + len(inputs[i]) > MAX_PASS_TOKENS:
                out[batch] = self._pass([inputs[j] for j in batch])
                batch = []
            batch.append(i)
        if batch:
            out[batch] = self._pass([inputs[j] for j in batch])
        return out

    @torch.inference_mode()
    def _pass(self, inputs: list[list[int]]) -> torch.Tensor:
        """One prefill of every input, each with blocks of its own in a cache made for it."""
        config, bs = self.config, BLOCK_SIZE
        num_blocks = sum(-(-len(ids) // bs) for ids in inputs)
        caches = allocate_layer_caches(config.num_layers, num_blocks, bs, config.num_kv_heads,
                                       config.head_dim, torch.float32, "auto")
        input_ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        next_block = 0
        for ids in inputs:
            table = list(range(next_block, next_block + -(-len(ids) // bs)))
            next_block += len(table)
            input_ids += ids
            positions += range(len(ids))
            slots += [table[p // bs] * bs + p % bs for p in range(len(ids))]
            starts.append(starts[-1] + len(ids))
            seq_lens.append(len(ids))
            tables.append(table)
        meta = AttentionMetadata.build(slots, starts, seq_lens, tables, bs)
        meta.num_requests = len(inputs)
        hidden = self.net(torch.tensor(input_ids, dtype=torch.long),
                          torch.tensor(positions, dtype=torch.long), caches, meta).float()
        if self.pooling_mode == "last":
            pooled = hidden[[end - 1 for end in starts[1:]]]
        else:
            pooled = torch.stack([hidden[a:b].mean(dim=0) for a, b in zip(starts, starts[1:])])
        return F.normalize(pooled, p=2, dim=1)
