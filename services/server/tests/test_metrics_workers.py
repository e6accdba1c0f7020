"""How ``/metrics`` merges the values of several worker processes (``HARU_WORKERS``).

Real processes share one ``PROMETHEUS_MULTIPROC_DIR``, as the workers of ``haru serve`` do:
two write their values, a third renders what ``/metrics`` would answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

WORKER = """
import sys
from haru_server._metrics import ServerMetrics

k = int(sys.argv[1])
metrics = ServerMetrics(version="test")
metrics.standby_seconds.labels("f", "d").inc(10)
metrics.standby_training_seconds.labels("f", "d").inc(5 if k == 0 else 10)
metrics.proxy_answered("f", "m", "/v1/models", 200, None)
metrics.watch_holding(lambda: 2)
# Both routed fleet g; worker 1 then dropped it (idle). Only worker 1 ever routed fleet h.
metrics.watch_lease_ages(lambda: {"g": 1.0} if k == 0 else {"g": 2.0, "h": 5.0})
metrics.refresh()
if k == 1:
    metrics.watch_lease_ages(lambda: {})
    metrics.refresh()
"""

SCRAPE = """
import json
from prometheus_client import ProcessCollector, generate_latest
from haru_server._metrics import ServerMetrics

print(generate_latest(ServerMetrics(version="test").exposition).decode())
own = {f.name: f.samples[0].value for f in ProcessCollector(registry=None).collect()}
print(json.dumps(own))
"""


def python(code: str, folder: Path, *args: str) -> str:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_one_scrape_merges_every_worker_as_documented(tmp_path: Path) -> None:
    for k in ("0", "1"):
        python(WORKER, tmp_path, k)
    text, own_line = python(SCRAPE, tmp_path).rstrip().rsplit("\n", 1)
    own = json.loads(own_line)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    fd = (("domain", "d"), ("fleet", "f"))
    # Counters are summed; the duty-cycle ratio is computed from the summed seconds.
    assert samples[("haru_standby_seconds_total", fd)] == 20
    assert samples[("haru_standby_training_seconds_total", fd)] == 15
    assert samples[("haru_standby_duty_cycle_ratio", fd)] == 0.75
    answered = (("fleet", "f"), ("model", "m"), ("route", "/v1/models"), ("status", "200"))
    assert samples[("haru_proxy_requests_total", answered)] == 2
    # Requests held now: the sum over the workers.
    assert samples[("haru_proxy_held_requests_in_flight", ())] == 4
    # Lease age: the oldest a worker still routes on; a lease no worker keeps is left out.
    assert samples[("haru_route_lease_age_seconds", (("fleet", "g"),))] == 1
    assert ("haru_route_lease_age_seconds", (("fleet", "h"),)) not in samples
    # One build info, and no runtime metrics (they would describe one process only).
    assert [k for k in samples if k[0] == "haru_build_info"] == [
        ("haru_build_info", (("version", "test"),))
    ]
    assert not [k for k in samples if k[0].startswith("python_")]
    # The process series of the live processes only: the two writers have exited, so only
    # the scraping process (which wrote files too) counts.
    assert samples[("process_start_time_seconds", ())] == own["process_start_time_seconds"]
    assert samples[("process_cpu_seconds_total", ())] > 0
    assert ("process_max_fds", ()) not in samples
