"""PEFT's LoRA folders (adapter_config.json + adapter_model.safetensors), as `peft` saves them.

Every option that changes what the adapter computes is honoured or refused by name: rank,
lora_alpha, use_rslora, rank_pattern and alpha_pattern are honoured; modules_to_save, DoRA,
trained biases and Conv1D-style (fan_in_fan_out) weights are refused, never ignored.
"""
from __future__ import annotations

import json
import math
import os
import re

import regex

from pagedllm.model_config import ModelConfig
from pagedllm.lora.adapter import (PART_TO_FUSED, AdapterError, LoRAAdapter, PartWeights,
                                   build_adapter, check_pair_shapes)

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# How long one alpha_pattern or rank_pattern key may take to match one module name. PEFT's
# keys are regexes from a file anyone can hand the server; Python's `re` can backtrack for
# ever on some (`(.*.*)*X`) while holding the GIL, which froze the whole server. The `regex`
# module matches with a time limit and lets other threads run meanwhile.
PATTERN_SECONDS = 0.05
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names


def is_peft_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_peft_folder(name: str, path: str, config: ModelConfig,
                     max_rank: int | None) -> LoRAAdapter:
    settings = _read_config(name, path)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise AdapterError(f"adapter {name}: {path} holds adapter_model.bin, a pickle file, "
                               f"which pagedllm does not read; save it with "
                               f"safe_serialization=True (adapter_model.safetensors)")
        raise AdapterError(f"adapter {name}: {path} has no {WEIGHTS_FILE}")
    # The header first: names, dtypes, shapes and ranks are checked before any tensor is
    # read (a 2 GB file of the wrong rank is refused at once, not after reading it).
    _pairs(name, _read_header(name, weights_path), config, max_rank)
    halves = _pairs(name, _read_safetensors(name, weights_path), config, max_rank)
    parts = {}
    for (layer, part), pair in halves.items():
        rank = pair["A"].shape[0]
        module = f"model.layers.{layer}.{'self_attn' if part in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{part}"
        alpha = _pattern_value(name, "alpha_pattern", settings.get("alpha_pattern") or {},
                               module, settings["lora_alpha"])
        scale = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
        parts[(layer, part)] = PartWeights(pair["A"], pair["B"], scale)
    return build_adapter(name, path, "peft", settings["lora_alpha"], parts, config, max_rank)


class _Header:
    """A tensor as the safetensors header describes it: its shape and dtype, no data."""

    def __init__(self, shape: list[int], dtype: str):
        self.shape, self.dtype = tuple(shape), dtype


def _pairs(name: str, tensors: dict, config: ModelConfig,
           max_rank: int | None) -> dict[tuple[int, str], dict[str, object]]:
    """(layer, part) -> {"A": ..., "B": ...}, every name and pair's shapes checked; tensors
    or their headers (_Header) alike."""
    halves: dict[tuple[int, str], dict[str, object]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(3) not in PART_TO_FUSED:
            raise AdapterError(f"adapter {name}: {WEIGHTS_FILE} holds `{key}`, a weight "
                               f"pagedllm does not apply (LoRA on q/k/v/o and gate/up/down "
                               f"projections only)")
        if isinstance(tensor, _Header) and tensor.dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"adapter {name}: `{key}` holds {tensor.dtype} weights; LoRA "
                               f"weights are floating point")
        layer, part, half = int(match.group(1)), match.group(3), match.group(4)
        halves.setdefault((layer, part), {})[half] = tensor
    for (layer, part), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name}: layer {layer} {part} has lora_{''.join(pair)} "
                               f"but not its other half")
        check_pair_shapes(name, layer, part, tuple(pair["A"].shape), tuple(pair["B"].shape),
                          config, max_rank)
    return halves


def _read_header(name: str, path: str) -> dict[str, _Header]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return {key: _Header(f.get_slice(key).get_shape(), f.get_slice(key).get_dtype())
                    for key in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"adapter {name}: {path} is not a readable safetensors file: "
                           f"{exc}") from exc


def _read_config(name: str, path: str) -> dict:
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            settings = json.load(f)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} cannot be read: {exc}") from exc
    if not isinstance(settings, dict):
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} is not a JSON object")
    kind = settings.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"adapter {name} is a {kind} adapter; pagedllm serves LoRA only")
    refusals = {
        "modules_to_save": "it trains whole modules besides its LoRA weights",
        "use_dora": "DoRA scales the weights' magnitudes, which pagedllm does not apply",
        "fan_in_fan_out": "its weights are stored transposed (Conv1D models)",
        "lora_bias": "it trains biases beside its LoRA weights",
    }
    for field, why in refusals.items():
        if settings.get(field):
            raise AdapterError(f"adapter {name}: {CONFIG_FILE} sets {field}: {why}; pagedllm "
                               f"cannot serve it as the adapter computes")
    if settings.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} sets bias={settings['bias']!r}: it "
                           f"trains biases, which pagedllm does not apply")
    settings["lora_alpha"] = _number(name, "lora_alpha", settings.get("lora_alpha", 8))
    for field in ("alpha_pattern", "rank_pattern"):
        patterns = settings.get(field) or {}
        if not isinstance(patterns, dict):
            raise AdapterError(f"adapter {name}: {CONFIG_FILE}'s {field} is a "
                               f"{type(patterns).__name__}, not an object of pattern: value")
        for pattern, value in patterns.items():
            _number(name, f"{field}[{pattern!r}]", value)
            try:
                regex.compile(pattern)
            except regex.error as exc:
                raise AdapterError(f"adapter {name}: {CONFIG_FILE}'s {field} key {pattern!r} "
                                   f"is not a regular expression: {exc}") from exc
    return settings


def _number(name: str, field: str, value) -> float:
    """A config field that must be a finite number (JSON's true/false are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdapterError(f"adapter {name}: {CONFIG_FILE}'s {field} is {value!r}, not a number")
    if not math.isfinite(value):
        raise AdapterError(f"adapter {name}: {CONFIG_FILE}'s {field} is {value!r}, not a finite "
                           f"number")
    return float(value)


def _pattern_value(name: str, field: str, patterns: dict, module: str, default: float) -> float:
    """PEFT's rule: the first pattern that matches the module name's end wins. A pattern
    that takes longer than PATTERN_SECONDS refuses the adapter."""
    for pattern, value in patterns.items():
        try:
            if regex.match(rf"(.*\.)?({pattern})$", module, timeout=PATTERN_SECONDS,
                           concurrent=True):
                return float(value)
        except TimeoutError as exc:
            raise AdapterError(f"adapter {name}: {CONFIG_FILE}'s {field} key {pattern!r} took "
                               f"over {PATTERN_SECONDS} s to match {module!r}; write it as a "
                               f"module name or a simple pattern") from exc
    return default


def _read_safetensors(name: str, path: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"adapter {name}: {path} is not a readable safetensors file: "
                           f"{exc}") from exc
