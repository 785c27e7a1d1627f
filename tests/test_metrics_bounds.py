"""Per-user metric series are bounded (server/metrics.py): 300 distinct 20 KB `user` values
leave /metrics small, hashed and capped; API key names keep series of their own; the
waiting-per-user gauge shows the busiest users plus "other". No model, no server."""
from prometheus_client import generate_latest

from pagedllm.config import CacheConfig
from pagedllm.core.snapshot import EngineStats
from pagedllm.kernels import capabilities
from pagedllm.server import metrics as metrics_module
from pagedllm.server.metrics import ServerMetrics
from pagedllm.serving.client import EngineFigures


def figures(waiting: dict) -> list[EngineFigures]:
    stats = EngineStats(0, len(waiting), 0, 10, 0.0, 0, 0, 0, 0, 0, 0)
    return [EngineFigures(stats, waiting, CacheConfig(16, 10, True, "auto"), capabilities())]


def test_many_long_user_values_leave_metrics_small_and_bounded():
    waiting = {f"user:{i}-" + "x" * 20_000: i % 5 + 1 for i in range(300)}
    metrics = ServerMetrics(lambda: figures(waiting), "m")
    for i in range(300):
        metrics.observe_user(f"user:{i}-" + "x" * 20_000, 10, 5)
    metrics.observe_user("alice", 1, 1, is_key=True)
    text = generate_latest(metrics.registry).decode()
    assert len(text) < 1 << 20
    users = {line.split('user="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("pagedllm:user_requests_total{")}
    assert len(users) == metrics_module.MAX_USER_LABELS + 2  # + "other" + the key
    assert "other" in users and "alice" in users
    assert all(len(u) <= 64 for u in users)
    waiting_rows = [line for line in text.splitlines()
                    if line.startswith("pagedllm:num_requests_waiting_by_user{")]
    assert len(waiting_rows) == metrics_module.MAX_WAITING_LABELS + 1
    total = sum(float(line.rsplit(" ", 1)[1]) for line in waiting_rows)
    assert total == sum(waiting.values())  # nobody's waiting is lost, only grouped


def test_short_user_values_and_key_names_stay_readable():
    metrics = ServerMetrics(lambda: figures({"user:bob": 2}), "m")
    metrics.observe_user("user:bob", 3, 4)
    text = generate_latest(metrics.registry).decode()
    assert 'pagedllm:user_requests_total{user="user:bob"} 1.0' in text
    assert 'pagedllm:num_requests_waiting_by_user{model_name="m",user="user:bob"} 2.0' in text


def test_a_gpu_engine_reports_its_kv_usage_under_vllm_gpu_name_too():
    stats = EngineStats(1, 0, 0, 10, 0.25, 0, 0, 0, 0, 0, 0)
    cache = CacheConfig(16, 10, True, "auto")
    rows = [EngineFigures(stats, {}, cache, capabilities(), device="cuda", model="big"),
            EngineFigures(stats, {}, cache, capabilities(), device="cpu", model="small")]
    text = generate_latest(ServerMetrics(lambda: rows, "m").registry).decode()
    assert 'pagedllm:gpu_cache_usage_perc{model_name="big"} 0.25' in text
    assert 'gpu_cache_usage_perc{model_name="small"}' not in text  # a CPU pool is not a GPU's
    assert 'pagedllm:kv_cache_usage_perc{model_name="small"} 0.25' in text
    cpu_only = generate_latest(ServerMetrics(lambda: rows[1:], "m").registry).decode()
    assert "gpu_cache_usage_perc" not in cpu_only
