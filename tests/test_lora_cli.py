"""LoRA's options: --lora's forms, the config, serve's refusals, and plan counting the slots
and adapters as serve holds them."""
import pytest

from pagedllm.cli import build_parser
from pagedllm.cli.options import engine_config, lora_modules
from pagedllm.config import LoRAConfig


def test_lora_takes_names_bare_paths_and_comma_lists():
    assert lora_modules("sql=/srv/sql,/srv/tone.gguf") == ["sql=/srv/sql", "tone=/srv/tone.gguf"]
    args = build_parser().parse_args(["serve", "--lora", "a=/x", "--lora-modules", "b=/y,/z/c/"])
    lora = engine_config(args).lora
    assert lora == LoRAConfig((("a", "/x"), ("b", "/y"), ("c", "/z/c/")), False, 4, 16)
    assert lora.active and not LoRAConfig().active and LoRAConfig(enabled=True).active
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora", "a="])
    with pytest.raises(ValueError, match="names must differ"):
        engine_config(build_parser().parse_args(["serve", "--lora", "a=/x,a=/y"]))


def test_a_name_without_its_path_is_told_to_write_name_equals_path(tmp_path, monkeypatch, capsys):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="'sql' is no file or folder here: write "
                                                         "NAME=PATH"):
        lora_modules("sql")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora", "sql"])
    assert "write NAME=PATH" in capsys.readouterr().err
    (tmp_path / "sql").mkdir()  # a bare word that does name a folder here is that path
    monkeypatch.chdir(tmp_path)
    assert lora_modules("sql") == ["sql=sql"]


def test_vllms_json_form_is_taken_and_its_fields_checked():
    import argparse

    [module] = lora_modules('{"name": "sql", "path": "/srv/sql", "base_model_name": "smollm2"}')
    assert module == "sql=/srv/sql" and module.base_model_name == "smollm2"
    args = build_parser().parse_args(["serve", "--lora-modules", '{"name": "a", "path": "/x"}'])
    assert engine_config(args).lora.adapters == (("a", "/x"),)
    assert args.lora[0].base_model_name is None
    for bad, words in (('{"name": "sql"}', "vLLM's form"), ('{"name": "a", "path": "/p", "r": 4}',
                       "unknown: r"), ("{nope", "not JSON"),
                       ('{"name": "a", "path": "/p", "base_model_name": 3}', "must be a string")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            lora_modules(bad)


def test_a_base_model_name_that_is_not_the_served_model_is_refused():
    from types import SimpleNamespace

    from pagedllm.cli.serve_checks import adapter_name_clash
    from pagedllm.server.server_config import ServerConfig

    client = SimpleNamespace(loras=None, info=SimpleNamespace(
        model_config=SimpleNamespace(name="SmolLM2-135M-Instruct")))
    config = ServerConfig(served_model_name="smollm2", model_aliases=("gpt-4o-mini",))
    ours = lora_modules('{"name": "a", "path": "/p", "base_model_name": "gpt-4o-mini"}')
    assert adapter_name_clash(client, config, ours) is None
    other = lora_modules('{"name": "a", "path": "/p", "base_model_name": "llama-3-8b"}')
    assert "a's base_model_name is 'llama-3-8b', but this server serves 'smollm2'" in \
        adapter_name_clash(client, config, other)


@pytest.mark.parametrize("extra", [["--models-dir", "/nowhere"], ["--replicas", "2"]])
def test_serve_refuses_lora_where_it_cannot_serve_it(extra, capsys):
    from pagedllm.cli.main import main

    assert main(["serve", "--lora", "a=/x", *extra]) == 2
    assert "adapters of one served model" in capsys.readouterr().err


def test_plan_counts_slots_and_adapters_as_serve_holds_them(tiny_llama, tiny_llama_folder,
                                                             tmp_path, capsys):
    import torch

    from pagedllm.cli.main import main
    from pagedllm.core import sizing
    from pagedllm.lora import load_adapter
    from pagedllm.lora.slots import LoRASlots
    from pagedllm.models.build import build_model
    from pagedllm.weights import load_checkpoint
    from test_lora_model import make_peft

    _, adapter = make_peft(tiny_llama, tmp_path / "a")
    checkpoint = load_checkpoint(tiny_llama_folder)
    config = checkpoint.config
    lora = LoRAConfig((("a", adapter),), max_loras=3, max_lora_rank=8)
    slots = LoRASlots(build_model(config, checkpoint.weights), config, lora, torch.bfloat16)
    assert sizing.lora_slot_bytes(config, 3, 8, 2) == slots.num_bytes
    expected = slots.num_bytes + load_adapter("a", adapter, config).num_bytes

    from pagedllm.tools.plan import make_plan

    plain = make_plan(tiny_llama_folder, dtype="bfloat16", context=256, parallels=[1],
                      memory=1 << 30)
    with_lora = make_plan(tiny_llama_folder, dtype="bfloat16", context=256, parallels=[1],
                          memory=1 << 30, lora=lora)
    assert with_lora.lora_bytes == expected
    assert with_lora.weight_bytes == plain.weight_bytes + expected
    assert main(["plan", "--model", tiny_llama_folder, "--context", "256", "--memory", "1GiB",
                 "--lora", f"a={adapter}", "--max-loras", "3", "--max-lora-rank", "8"]) == 0
    out = capsys.readouterr().out
    assert "LoRA slots and adapters" in out
    assert f"--max-loras 3 --max-lora-rank 8 --lora a={adapter}" in out


def test_plan_refuses_an_adapter_it_cannot_serve(tiny_llama, tiny_llama_folder, tmp_path,
                                                 capsys):
    from pagedllm.cli.main import main
    from test_lora_model import make_peft

    _, adapter = make_peft(tiny_llama, tmp_path / "a", r=8)
    assert main(["plan", "--model", tiny_llama_folder, "--lora", f"a={adapter}",
                 "--max-lora-rank", "4"]) == 2
    assert "rank 8, above this server's --max-lora-rank 4" in capsys.readouterr().err


def test_a_key_file_marks_admins_and_refuses_a_vague_answer(tmp_path):
    from pagedllm.server.auth import KeyFileError, parse_key_file

    path = tmp_path / "keys.txt"
    path.write_text("alice sk-alice-0123 admin=yes\nbob sk-bob-012345 admin=no\ncarol sk-carol-0123\n")
    assert [k.admin for k in parse_key_file(str(path))] == [True, False, False]
    path.write_text("alice sk-alice-0123 admin=maybe\n")
    with pytest.raises(KeyFileError, match="admin is yes or no"):
        parse_key_file(str(path))


def test_a_models_table_entry_names_its_adapters(tmp_path):
    from pagedllm.config import EngineConfig
    from pagedllm.serving.model_store import StoreError, entries_from_table
    from pagedllm.weights import default_model_path

    model = default_model_path()
    [listed] = entries_from_table({"chat": {"path": model, "loras": ["sql=sql-lora"]}}, "f.toml",
                                  str(tmp_path))
    [table] = entries_from_table({"chat": {"path": model, "loras": {"tone": "/srv/tone.gguf"}}},
                                 "f.toml")
    assert listed.loras == (("sql", str(tmp_path / "sql-lora")),)
    assert table.loras == (("tone", "/srv/tone.gguf"),)
    config = listed.engine_config(EngineConfig(lora=LoRAConfig(max_loras=2, max_lora_rank=32)))
    assert config.lora == LoRAConfig((("sql", str(tmp_path / "sql-lora")),), True, 2, 32)
    with pytest.raises(StoreError, match="loras is a list"):
        entries_from_table({"chat": {"path": model, "loras": "sql"}}, "f.toml")
