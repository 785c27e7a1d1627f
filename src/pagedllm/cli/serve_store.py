"""`pagedllm serve --models-dir` / `[models]`: a model store checked before anything loads,
then served (serving/model_pool.py)."""
from __future__ import annotations

import os
import signal
import sys

from pagedllm.cli.embedding_model import EmbeddingModelError, load_embeddings


def store_table(args) -> dict:
    if not args.config:
        return {}
    from pagedllm.cli.config_file import models_table

    return models_table(args.config)


def serve_store(args, engine_settings, config) -> int:
    """A model store: the catalog checked now, each model loaded on its first request."""
    from pagedllm.core.residency import KeepAliveError, parse_keep_alive
    from pagedllm.server.runner import serve
    from pagedllm.serving.model_pool import ModelPool
    from pagedllm.serving.model_store import (ModelCatalog, StoreEntry, StoreError,
                                              entries_from_table, scan_models_dir)

    if args.replicas is not None:
        print("error: --replicas does not serve a model store yet; run one model per "
              "server with --replicas", file=sys.stderr)
        return 2
    if args.model_alias:
        print("error: --model-alias names the one --model; in a store give a model its "
              "aliases in its [models] entry (aliases = [\"gpt-4o-mini\"])", file=sys.stderr)
        return 2
    if args.served_model_name and not args.model:
        print("error: --served-model-name names --model; a store's models are named by their "
              "files, folders or [models] entries", file=sys.stderr)
        return 2
    try:
        keep_alive = parse_keep_alive(args.keep_alive)
        entries = scan_models_dir(args.models_dir) if args.models_dir else []
        entries += entries_from_table(store_table(args), args.config or "",
                                      os.path.dirname(os.path.abspath(args.config or ".")))
        first = None
        if args.model:  # joins the store, loaded now
            first = args.served_model_name or _model_name(args.model)
            entries.append(StoreEntry(first, os.path.abspath(args.model)))
        catalog = ModelCatalog(entries)
    except (StoreError, KeepAliveError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pool = ModelPool(catalog, engine_settings, max_loaded_models=args.max_loaded_models,
                     max_memory=args.max_memory, keep_alive=keep_alive)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from pagedllm.errors import ModelLoadError
    from pagedllm.server.loading import LoadingServer

    try:
        with LoadingServer(args.host, args.port, args.ssl_certfile, args.ssl_keyfile):
            embeddings = load_embeddings(args.embedding_model, args.pooling, args.embedding_dtype)
            if first is not None:
                pool.preload(first)
    except (EmbeddingModelError, ModelLoadError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        pool.shutdown()
        return 2
    return serve(pool, config, embeddings)


def _model_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[:-len(".gguf")] if base.lower().endswith(".gguf") else base
