"""The engine process's front end keeps its adapters' descriptions, not their weights
(serving/front_adapters.py): each is read and checked whole (a bad file is refused before
the engine hears of it), listed with its rank and size, and every load and unload is sent
on to the engine; a fresh engine is told what changed since the start."""
import dataclasses

import pytest

from pagedllm.config import EngineConfig, LoRAConfig
from pagedllm.engine import wire
from pagedllm.errors import AdapterError
from pagedllm.lora import load_adapter
from pagedllm.lora.registry import LoRARegistry
from pagedllm.serving.front_adapters import FrontAdapters
from pagedllm.weights import load_checkpoint

from lora_adapters import write_adapter


@pytest.fixture(scope="module")
def model_config(tiny_llama_folder):
    return load_checkpoint(tiny_llama_folder).config


def _config(tiny_llama_folder, adapters=()) -> EngineConfig:
    return EngineConfig(tiny_llama_folder, lora=LoRAConfig(tuple(adapters), True, 2, 8))


def test_the_front_keeps_descriptions_and_forwards_every_change(model_config, tiny_llama_folder,
                                                                tmp_path):
    start = write_adapter(tmp_path / "start", {"lora_alpha": 4})
    sent = []
    front = FrontAdapters(model_config, _config(tiny_llama_folder, [("start", start)]),
                          lambda message: sent.append(message) or True)
    assert sent == []  # the engine loads the start's adapters itself
    later = write_adapter(tmp_path / "later", {"lora_alpha": 8})
    adapter = front.load("later", later)
    whole = load_adapter("later", later, model_config)
    assert adapter.modules == {} and adapter.num_bytes == whole.num_bytes > 0
    assert (adapter.rank, adapter.key, adapter.targets) == (whole.rank, whole.key, whole.targets)
    front.unload("start")
    assert sent == [wire.LoadAdapter("later", later), wire.UnloadAdapter("start")]
    assert front.changes_since_start() == [wire.UnloadAdapter("start"),
                                           wire.LoadAdapter("later", later)]
    assert [a.name for a in front.adapters()] == ["later"]


def test_a_bad_file_is_refused_here_and_the_engine_never_hears_of_it(model_config,
                                                                     tiny_llama_folder, tmp_path):
    sent = []
    front = FrontAdapters(model_config, _config(tiny_llama_folder), sent.append)
    bad = write_adapter(tmp_path / "bad", {"lora_alpha": float("inf")})
    with pytest.raises(AdapterError, match="lora_alpha is inf"):
        front.load("bad", bad)
    with pytest.raises(KeyError):
        front.unload("bad")
    assert sent == [] and front.adapters() == [] and front.changes_since_start() == []


def test_a_model_name_resolves_to_an_adapter_with_or_without_latest(model_config, tmp_path):
    registry = LoRARegistry(model_config, dataclasses.replace(LoRAConfig(), max_loras=1))
    registry.load("sql", write_adapter(tmp_path / "sql", {"lora_alpha": 4}))
    assert registry.named("sql") == registry.named("sql:latest") == "sql"
    assert registry.named("SQL") is None and registry.named(None) is None
    assert registry.named("smollm2") is None
