"""EngineConfig: every engine default written once, bad values refused before anything loads,
and the CLI and LLM(**kwargs) both arriving at it."""
import pytest

from pagedllm.config import (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS,
                             GPU_MAX_NUM_BATCHED_TOKENS, CacheConfig, EngineConfig,
                             SchedulerConfig)


def test_defaults_are_written_once():
    config = EngineConfig()
    assert config.block_size == CacheConfig().block_size == DEFAULT_BLOCK_SIZE
    assert config.max_num_batched_tokens is None  # by device:
    assert config.step_budget("cpu") == SchedulerConfig().max_num_batched_tokens \
        == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert config.step_budget("cuda") == GPU_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig(max_num_batched_tokens=512).step_budget("cuda") == 512
    assert (config.dtype, config.kv_cache_dtype, config.max_num_seqs) == ("float32", "auto", "auto")


@pytest.mark.parametrize("field,value,message", [
    ("dtype", "float16", "dtype must be one of float32, bfloat16"),
    ("kv_cache_dtype", "fp8", "kv_cache_dtype must be one of auto, int8"),
    ("block_size", 0, "block_size must be positive"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be positive"),
    ("max_num_seqs", 0, "max_num_seqs must be 'auto' or positive"),
    ("max_num_seqs", "many", "max_num_seqs must be 'auto' or positive"),
    ("max_num_seqs", True, "max_num_seqs must be 'auto' or positive"),
])
def test_bad_values_are_refused_when_made(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_cli_builds_the_config():
    from pagedllm.cli import build_parser, engine_config

    config = engine_config(build_parser().parse_args(
        ["serve", "--block-size", "32", "--max-num-seqs", "4", "--no-prefix-caching",
         "--kv-cache-memory", "1e8"]))
    assert isinstance(config, EngineConfig)
    assert (config.block_size, config.max_num_seqs, config.enable_prefix_caching) == (32, 4, False)
    assert config.kv_cache_memory == 100_000_000 and config.dtype == "bfloat16"  # the CLI's default
    assert config.step_budget("cpu") == DEFAULT_MAX_NUM_BATCHED_TOKENS
    with pytest.raises(SystemExit):  # refused by the parser, naming the option
        build_parser().parse_args(["serve", "--block-size", "0"])
    with pytest.raises(ValueError, match="max_num_seqs must be 'auto' or positive"):
        engine_config(build_parser().parse_args(["serve", "--max-num-seqs", "0"]))


def test_engine_takes_a_config_or_its_fields(tiny_llama_gguf):
    from pagedllm import LLM
    from pagedllm.engine.engine import LLMEngine

    config = EngineConfig(model=str(tiny_llama_gguf), kv_cache_memory=4 << 20, max_num_seqs=3)
    engine = LLMEngine(config)
    assert engine.config is config and engine.scheduler_config.max_num_seqs == 3
    assert LLMEngine(config, max_num_seqs=2).scheduler_config.max_num_seqs == 2
    llm = LLM(str(tiny_llama_gguf), kv_cache_memory=4 << 20, block_size=8)
    assert llm.engine.cache_config.block_size == 8
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(str(tiny_llama_gguf), dtype="int4")


def test_cli_builds_one_frozen_server_config():
    import dataclasses

    from pagedllm.cli import build_parser, server_config
    from pagedllm.server.server_config import ServerConfig

    default = server_config(build_parser().parse_args(["serve"]))
    assert default == ServerConfig(), "the CLI's defaults are ServerConfig's"
    assert default.host == "127.0.0.1"  # loopback unless told otherwise
    config = server_config(build_parser().parse_args(
        ["serve", "--allowed-origins", "http://a.example, http://b.example", "--max-body-bytes", "1000",
         "--max-queue", "5", "--shutdown-grace", "2"]))
    assert config.allowed_origins == ("http://a.example", "http://b.example")
    aliased = server_config(build_parser().parse_args(
        ["serve", "--model-alias", "gpt-4o-mini, claude-*", "--allowed-origins", "localhost"]))
    assert aliased.model_aliases == ("gpt-4o-mini", "claude-*")
    assert aliased.allowed_origins == ("localhost",)
    assert (config.max_body_bytes, config.max_queue, config.shutdown_grace) == (1000, 5, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_queue = 6


def test_auto_max_num_seqs_is_capped_by_device():
    """'auto' fills the KV pool with ~1,024-token requests, at most 64 on a CPU and 256 on a
    GPU (where more requests a step cost little more than one)."""
    from pagedllm.core import sizing

    roomy = 100_000  # blocks of 16: room for ~1,500 such requests
    assert sizing.auto_max_num_seqs(roomy, 16, 8192, sizing.auto_max_num_seqs_cap("cpu")) == 64
    assert sizing.auto_max_num_seqs(roomy, 16, 8192, sizing.auto_max_num_seqs_cap("cuda")) == 256
    assert sizing.auto_max_num_seqs(640, 16, 8192, sizing.auto_max_num_seqs_cap("cuda")) == 10
