"""`serve`'s refusals: a setup checked before anything loads (the address, keys, TLS files,
options that do not go together), and the adapters named at start once the model is known.
Each is one line (`error: ...`, exit status 2), never a traceback."""
from __future__ import annotations

import os
import sys

from pagedllm.cli.options import engine_config


class SetupError(Exception):
    """A setup refused before anything loads: said as `error: ...`, exit status 2."""


def adapter_name_clash(client, config, modules=()) -> str | None:
    """An adapter named at start (--lora) that reads as the served model's name, or whose
    base_model_name (vLLM's JSON form) names another model."""
    from pagedllm.server.lora_routes import model_name_clash

    served = config.served_model_name or client.info.model_config.name
    for module in modules:
        base = module.base_model_name
        if base is not None and base not in (served, *config.model_aliases):
            return (f"{module.split('=', 1)[0]}'s base_model_name is {base!r}, but this server "
                    f"serves {served!r} (--served-model-name, --model-alias)")
    for adapter in client.loras.adapters() if client.loras is not None else ():
        clash = model_name_clash(adapter.name, served, config.model_aliases)
        if clash is not None:
            return clash
    return None


def check_server_setup(args) -> None:
    """The address, keys and TLS files: SetupError for what cannot serve."""
    from pagedllm.server.auth import KeyFileError, parse_key_file, permission_warning
    from pagedllm.server.runner import check_binding, port_in_use

    refusal = check_binding(args.host, args.api_key_file, args.insecure_no_auth)
    if refusal:
        raise SetupError(refusal)
    if args.api_key_file:
        try:
            parse_key_file(args.api_key_file)
        except KeyFileError as exc:
            raise SetupError(str(exc)) from exc
        warning = permission_warning(args.api_key_file)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise SetupError("--ssl-certfile and --ssl-keyfile go together")
    busy = port_in_use(args.host, args.port)
    if busy:
        raise SetupError(busy)
    if args.chat_template is not None:
        from pagedllm.cli.serve_store import store_table

        store = args.models_dir is not None or bool(store_table(args))
        args.chat_template = chat_template_text(args.chat_template, store)


def chat_template_text(given: str, store: bool = False) -> str:
    """--chat-template: a file's text, or the template itself; SetupError for one that is
    neither or does not parse."""
    from pagedllm.tokenizer.template_source import read_chat_template

    if store:
        raise SetupError("--chat-template replaces one model's template: with a model store "
                         "(--models-dir, [models]) give it per model, as chat-template in "
                         "its [models] entry")
    try:
        return read_chat_template(given)
    except ValueError as exc:
        raise SetupError(f"--chat-template {exc}") from exc


def check_engine_setup(args):
    """The engine's settings, and options that do not go together: SetupError for those."""
    from pagedllm.cli.serve_store import store_table

    try:
        engine_settings = engine_config(args)
    except ValueError as exc:
        raise SetupError(str(exc)) from exc
    if engine_settings.device == "cuda":  # refused before anything loads, with why
        from pagedllm.backends import DeviceError, check_device
        try:
            check_device(engine_settings.device)
        except DeviceError as exc:
            raise SetupError(str(exc)) from exc
    if args.model is not None and not os.path.exists(args.model):
        raise SetupError(f"no model at {args.model}: no such file or folder; {MODEL_HINT}")
    several = args.models_dir is not None or store_table(args) or args.replicas is not None
    if args.engine_process and several:
        raise SetupError("--engine-process serves one model; a model store (--models-dir, "
                         "[models]) and --replicas run their engines their own way (threads "
                         "of this process, Ray's processes): leave it out")
    if engine_settings.lora.active and several:
        raise SetupError("--lora and --enable-lora name adapters of one served model; in a "
                         "model store (--models-dir, [models]) a model's adapters sit in "
                         "NAME.loras/ beside it (or its [models] entry's loras), and "
                         "--replicas does not serve them yet")
    if args.replicas is not None and args.embedding_model and not (
            args.models_dir is not None or store_table(args)):
        raise SetupError("--embedding-model is not served with --replicas yet; run it on a "
                         "server of its own")
    return engine_settings


MODEL_HINT = ("--model takes a GGUF file (on Hugging Face, search the model's name with "
              "\"GGUF\" and download one .gguf, such as *-Q4_K_M.gguf) or a Hugging Face "
              "folder (config.json, *.safetensors, tokenizer.json); without --model the "
              "bundled SmolLM2-135M-Instruct is served")
