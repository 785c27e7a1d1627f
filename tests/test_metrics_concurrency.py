"""/metrics read from several threads while requests from many users come and go: every
scrape answers (the per-user waiting gauge reads a snapshot the engine thread publishes, not
the scheduler's live dicts, which once raised "dictionary changed size during iteration")."""
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families


def test_metrics_hammered_while_requests_run(server, client):
    failures: list[str] = []
    scrapes: list[int] = []
    stop = threading.Event()

    def scrape():
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while not stop.is_set():
                response = http.get("/metrics")
                if response.status_code != 200:
                    failures.append(f"{response.status_code}: {response.text[:200]}")
                    return
                names = {f.name for f in text_string_to_metric_families(response.text)}
                if "pagedllm:num_requests_waiting_by_user" not in names:
                    failures.append("the per-user gauge is missing")
                scrapes.append(1)

    def ask(i: int):
        try:
            done = client.completions.create(model="smollm2", prompt=f"Count to {i}:", max_tokens=12,
                                             temperature=0, user=f"user-{i}")
            if done.choices[0].finish_reason not in ("length", "stop"):
                failures.append(f"request {i}: {done.choices[0].finish_reason}")
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(f"request {i}: {exc}")

    scrapers = [threading.Thread(target=scrape) for _ in range(4)]
    askers = [threading.Thread(target=ask, args=(i,)) for i in range(24)]
    for t in scrapers + askers:
        t.start()
    for t in askers:
        t.join(120)
    stop.set()
    for t in scrapers:
        t.join(30)
    assert not failures, failures[:5]
    assert len(scrapes) >= 8  # the scrapers really ran alongside
