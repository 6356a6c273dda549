"""Scraping a Prometheus endpoint in tests: validated by promtool where the Debian `prometheus`
package is installed, always by the client library's own parser (prometheus-client)."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 30.0
PROMTOOL = shutil.which("promtool")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(address: tuple[str, int]) -> Samples:
    """GET /metrics, validated, as {(sample name, labels): value}."""
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
        text = r.read().decode()
    if PROMTOOL is not None:  # the Prometheus project's own linter
        check = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, check.stdout + check.stderr
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels``."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert found, f"no sample {name}{labels}"
    return sum(found)


def scrape_until(
    address: tuple[str, int], ok: Callable[[Samples], bool], what: str, timeout: float = 60.0
) -> Samples:
    """Scrapes until ``ok(samples)`` holds (bounded: only against a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(address)
        if ok(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.05)
