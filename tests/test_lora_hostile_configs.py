"""Adapters as an attacker or a careless hand writes them: a pattern that backtracks for
ever, non-finite or huge alphas, config fields of the wrong type, integer or rank-0 weights.
Each is refused with one line naming what is wrong (never a traceback, a 500 or a frozen
server); a sane one still loads. Hand-made PEFT folders over the tiny model (no training)."""
import pytest
import torch

from pagedllm.errors import AdapterError
from pagedllm.lora import load_adapter
from pagedllm.lora import peft_folder
from pagedllm.weights import load_checkpoint

from lora_adapters import write_adapter


@pytest.fixture(scope="module")
def config(tiny_llama_folder):
    return load_checkpoint(tiny_llama_folder).config


def test_a_sane_adapter_with_patterns_loads_with_their_alphas(config, tmp_path):
    path = write_adapter(tmp_path / "a", {"lora_alpha": 8, "alpha_pattern": {"q_proj": 4},
                                          "rank_pattern": {"q_proj": 2}})
    adapter = load_adapter("a", path, config)
    assert adapter.alpha == 8.0 and adapter.rank == 2
    [(_, fused)] = adapter.modules.items()
    a, b = fused.parts[0]
    assert torch.allclose(b, torch.full((64, 2), 0.01) * (4 / 2))  # alpha_pattern's 4, not 8


def test_a_pattern_that_makes_pythons_re_backtrack_for_ever_loads_at_once(config, tmp_path):
    """`(.*.*)*X` held the GIL in `re` for ever (the whole server froze); the time-limited
    matcher answers "no match" and the adapter keeps its lora_alpha."""
    path = write_adapter(tmp_path / "a", {"lora_alpha": 8, "alpha_pattern": {"(.*.*)*X": 1}})
    adapter = load_adapter("a", path, config)
    [(_, fused)] = adapter.modules.items()
    assert torch.allclose(fused.parts[0][1], torch.full((64, 2), 0.01) * 4)


def test_a_pattern_that_runs_out_of_its_time_refuses_the_adapter(config, tmp_path, monkeypatch):
    def slow_match(*args, timeout=None, **kwargs):
        assert timeout == peft_folder.PATTERN_SECONDS  # every match is bounded
        raise TimeoutError("regex timed out")

    monkeypatch.setattr(peft_folder.regex, "match", slow_match)
    path = write_adapter(tmp_path / "a", {"lora_alpha": 8, "alpha_pattern": {"q_p.*": 1}})
    with pytest.raises(AdapterError, match=r"alpha_pattern key 'q_p\.\*' took over 0.05 s"):
        load_adapter("a", path, config)


@pytest.mark.parametrize("settings, message", [
    ({"lora_alpha": "abc"}, "lora_alpha is 'abc', not a number"),
    ({"lora_alpha": None}, "lora_alpha is None, not a number"),
    ({"lora_alpha": True}, "lora_alpha is True, not a number"),
    ({"lora_alpha": float("nan")}, "lora_alpha is nan, not a finite number"),
    ({"lora_alpha": float("inf")}, "lora_alpha is inf, not a finite number"),
    ({"lora_alpha": 1e38}, r"scale \(alpha / rank\) is 5e\+37; pagedllm serves scales of at most 1000"),
    ({"lora_alpha": 8, "alpha_pattern": ["q_proj"]}, "alpha_pattern is a list, not an object"),
    ({"lora_alpha": 8, "rank_pattern": "q_proj"}, "rank_pattern is a str, not an object"),
    ({"lora_alpha": 8, "alpha_pattern": {"(": 2}}, "alpha_pattern key '\\(' is not a regular expression"),
    ({"lora_alpha": 8, "alpha_pattern": {"q_proj": "x"}}, r"alpha_pattern\['q_proj'\] is 'x', not a number"),
    ({"lora_alpha": 8, "alpha_pattern": {"q_proj": float("nan")}}, "not a finite number"),
])
def test_bad_config_fields_are_refused_by_name(config, tmp_path, settings, message):
    path = write_adapter(tmp_path / "a", settings)
    with pytest.raises(AdapterError, match=message) as caught:
        load_adapter("a", path, config)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("a, b, message", [
    (torch.ones(2, 64, dtype=torch.int64), torch.ones(64, 2, dtype=torch.int64), "holds I64 weights"),
    (torch.ones(2, 64, dtype=torch.bool), torch.ones(64, 2, dtype=torch.bool), "holds BOOL weights"),
    (torch.zeros(0, 64), torch.zeros(64, 0), r"has A \(0, 64\): a LoRA A is a \[rank, inputs\] matrix"),
    (torch.zeros(64), torch.zeros(64, 2), r"has A \(64,\)"),
])
def test_weights_that_are_not_a_float_lora_pair_are_refused(config, tmp_path, a, b, message):
    path = write_adapter(tmp_path / "a", {"lora_alpha": 8}, a, b)
    with pytest.raises(AdapterError, match=message):
        load_adapter("a", path, config)


def test_rank_and_shapes_are_checked_from_the_header_before_any_tensor_is_read(
        config, tmp_path, monkeypatch):
    """A file of the wrong rank or for another model is refused from its header (a 2 GB file
    used to be read whole first); the adapter's shape is said as the adapter's."""
    def never(*args):
        raise AssertionError("the tensors were read")

    monkeypatch.setattr(peft_folder, "_read_safetensors", never)
    wide = write_adapter(tmp_path / "wide", {"lora_alpha": 8}, torch.ones(8, 64), torch.ones(64, 8))
    with pytest.raises(AdapterError, match="has rank 8, above this server's --max-lora-rank 4"):
        load_adapter("a", wide, config, max_rank=4)
    other = write_adapter(tmp_path / "other", {"lora_alpha": 8}, torch.ones(2, 96), torch.ones(80, 2))
    with pytest.raises(AdapterError, match=r"is 80x96 in the adapter \(B \(80, 2\), A \(2, 96\)\) "
                                           r"but 64x64 in the base model"):
        load_adapter("a", other, config)


def test_a_bad_config_is_named_before_the_weights_are_read(config, tmp_path):
    """The config's refusal, not the weights' (here not finite): the config is checked first."""
    path = write_adapter(tmp_path / "a", {"lora_alpha": "abc"}, torch.full((2, 64), float("nan")))
    with pytest.raises(AdapterError, match="lora_alpha is 'abc'"):
        load_adapter("a", path, config)
