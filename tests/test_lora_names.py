"""Adapter names that read as another (core/adapter_names.py): case, NFKC forms and Unicode's
confusables are the same name to a person choosing a model, so they are the same name here."""
import pytest

from pagedllm.errors import AdapterError
from pagedllm.core.adapter_names import check_name, look_alike
from pagedllm.server.lora_routes import model_name_clash


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2", "sm\u043ellm2", "\uff53mollm2",
                                  "smollm2:latest", "SMOLLM2:LATEST"])
def test_names_that_read_as_the_model(name):
    assert look_alike(name, ["smollm2", "smollm2:latest"]) is not None
    assert "reads as the served model's name" in model_name_clash(name, "smollm2", ())


@pytest.mark.parametrize("name", ["sql", "smollm3", "smollm2-sql", "zorblax"])
def test_other_names_are_free(name):
    assert look_alike(name, ["smollm2", "quibbit"]) is None
    assert model_name_clash(name, "smollm2", ()) is None


def test_an_alias_pattern_is_the_models_name_too():
    assert "--model-alias" in model_name_clash("gpt-4o-mini", "smollm2", ("gpt-4o*",))
    assert model_name_clash("sql", "smollm2", ("gpt-4o*",)) is None


@pytest.mark.parametrize("bad", ["", " ", "a b", "tab\there", "x" * 129, "bell\x07"])
def test_names_that_cannot_be_written(bad):
    with pytest.raises(AdapterError):
        check_name(bad)


def test_the_registry_refuses_a_second_name_that_reads_as_the_first(tmp_path, tiny_llama_folder):
    from pagedllm.config import LoRAConfig
    from pagedllm.lora.registry import LoRARegistry
    from pagedllm.weights import load_checkpoint

    from lora_adapters import write_adapter

    registry = LoRARegistry(load_checkpoint(tiny_llama_folder).config, LoRAConfig())
    path = write_adapter(tmp_path / "a", {"lora_alpha": 4})
    registry.load("sql", path)
    for twin in ("SQL", "\u0455ql"):  # a Cyrillic dze for the s
        with pytest.raises(AdapterError, match="reads as the loaded adapter 'sql'"):
            registry.load(twin, path)
    with pytest.raises(AdapterError, match="already loaded"):
        registry.load("sql", path)
    assert [a.name for a in registry.adapters()] == ["sql"]
