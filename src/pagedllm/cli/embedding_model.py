"""`serve --embedding-model`: the embedding model's service from its name or path (the
bundled all-minilm, a sentence-transformers folder, or a decoder model pooled), for the
one-model server (cli/serve.py) and the store (cli/serve_store.py) alike."""
from __future__ import annotations

import os


class EmbeddingModelError(Exception):
    """--embedding-model names nothing servable (the message says what was looked for)."""


def load_embeddings(name: str | None, pooling: str | None = None, dtype: str = "auto"):
    """The embedding model's service, or None without --embedding-model: the bundled
    all-minilm, a sentence-transformers folder (its own pooling), or a decoder model (a GGUF
    file or Hugging Face folder) pooled by --pooling."""
    if not name:
        if pooling:
            raise EmbeddingModelError("--pooling goes with --embedding-model (a decoder model)")
        return None
    from pagedllm.embeddings.packaged import NAME, is_packaged_name, packaged_folder
    from pagedllm.embeddings.service import EmbeddingService
    from pagedllm.errors import ModelLoadError

    try:
        if is_packaged_name(name):
            folder, served = packaged_folder(), NAME
        elif os.path.exists(name):
            folder, served = name, None  # named after its file or folder
        else:
            raise EmbeddingModelError(
                f"--embedding-model {name}: no such file or folder; it takes all-minilm "
                f"(bundled), a sentence-transformers folder (config.json, model.safetensors, "
                f"tokenizer.json, modules.json) or a decoder model's GGUF file or folder "
                f"(with --pooling last|mean)")
        if os.path.isfile(os.path.join(folder, "modules.json")):
            from pagedllm.embeddings.sentence_model import SentenceModel

            if pooling:
                raise EmbeddingModelError(
                    f"--pooling: {name} is a sentence-transformers model, whose pooling is its "
                    f"own (1_Pooling/config.json); --pooling is for decoder models")
            return EmbeddingService(SentenceModel(folder, served, dtype))
        from pagedllm.embeddings.decoder_model import DecoderEmbeddingModel

        return EmbeddingService(DecoderEmbeddingModel(folder, pooling, served))
    except ModelLoadError as exc:
        raise EmbeddingModelError(f"--embedding-model: {exc}") from exc
