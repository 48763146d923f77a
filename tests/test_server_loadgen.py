"""The load generator (`bench --load`) on a tiny model: Poisson arrivals, the per-rate report, the knee."""

import pytest
from kvbook.runtime.engine import Engine
from kvbook.serving.loadgen import format_load, knee, poisson_arrivals, run_load
from kvbook.serving.server import BackgroundServer

from .conftest import small_config
from .test_server import KEY_ENV


def test_poisson_arrivals_have_the_offered_rate():
    times = poisson_arrivals(4.0, 2001, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0 and all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)  # 2000 exponential gaps of mean 1/rate
    assert poisson_arrivals(4.0, 10, seed=3) == times[:10]  # seeded


def test_knee_is_the_first_rate_whose_median_ttft_doubles():
    rows = [{"rate": r, "ttft_ms": {"p50": t}} for r, t in [(0.5, 100), (1, 150), (2, 250), (4, 900)]]
    assert knee(rows) == 2
    assert knee(rows[:2]) is None


def test_run_load_against_a_running_server(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    config = small_config(vocab=151936, max_cache_len=256)
    with BackgroundServer(Engine(config, progress=False)) as server:
        result = run_load(config, "unused", [], [2.0, 8.0], count=6, max_tokens=4, url=server.url,
                          progress=lambda line: None)
        metrics = server.app.state.metrics
        served = metrics.request_success.labels(model_name="tiny", finished_reason="length")._value.get()
    assert [r["rate"] for r in result["rates"]] == [2.0, 8.0]
    for row in result["rates"]:
        assert row["ok"] == 6 and row["errors"] == []
        assert row["output_tokens_per_s"] == pytest.approx(4 * row["requests_per_s"])
        assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p90"] <= row["ttft_ms"]["p99"]
        assert 0 < row["itl_ms"]["p50"] <= row["itl_ms"]["p99"]
    assert served == 2 + 6 + 6  # the warm-up's two and every measured request
    table = format_load(result)
    assert "TTFT p50" in table and "knee:" in table
