"""A first run draws the random weights and caches them while the model is already in use. Whatever it reports
must belong to the call that asked (in a notebook: the cell that created the Engine), not to whatever runs when
the background write finishes."""

import logging
import threading

import pytest
import torch
from kvbook.model import quant
from kvbook.model.weights import CacheWrites, load_random_weights, random_weights_path
from kvbook.runtime.engine import Engine

from .conftest import small_config


def test_a_first_run_reports_caching_in_the_calling_thread_and_nothing_afterwards(weight_cache, capfd, caplog):
    cfg = small_config().model
    writes = CacheWrites()
    with caplog.at_level(logging.INFO, logger="kvbook.model.weights"):
        load_random_weights(cfg, torch.float32, progress=True, writes=writes)
        said_by_the_call = capfd.readouterr().err
        writes.wait()
    path = random_weights_path(cfg, torch.float32)
    assert f"caching the weights in {path}" in said_by_the_call
    assert capfd.readouterr() == ("", "")  # the background write printed nothing into the next "cell"
    assert path.exists()
    assert any(f"cached weights in {path}" in record.getMessage() for record in caplog.records)  # logged, quietly


def test_a_write_that_fails_is_a_logged_warning_and_leaves_no_partial_file(weight_cache, capfd, caplog):
    cfg = small_config().model
    weight_cache.parent.mkdir(parents=True)
    weight_cache.write_text("a file where the cache directory should be")  # makes the write fail
    with caplog.at_level(logging.WARNING, logger="kvbook.model.weights"):
        weights = load_random_weights(cfg, torch.float32, progress=False)  # no writes given: written before it returns
    assert weights  # the model still got its weights
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "could not cache weights" in caplog.records[0].getMessage()
    assert capfd.readouterr().err == ""  # no thread traceback


def _saving() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("save ")]


def test_writes_asked_for_while_an_engine_builds_start_once_the_model_is_whole(weight_cache, monkeypatch):
    cfg = small_config().model
    path = random_weights_path(cfg, torch.float32)
    writes = CacheWrites()
    load_random_weights(cfg, torch.float32, progress=False, writes=writes)
    assert _saving() == [] and not path.exists()  # asked for, not started: the CPUs keep building
    writes.wait()
    assert path.exists() and writes.queued == writes.started == []

    seen_while_quantizing = []
    quantize = quant.quantize_model

    def watched(*args, **kwargs):
        seen_while_quantizing.append((_saving(), random_weights_path(small_config(layers=3).model, torch.float32)
                                      .exists()))
        return quantize(*args, **kwargs)

    monkeypatch.setattr("kvbook.runtime.engine.quant.quantize_model", watched)
    engine = Engine(small_config(layers=3).replace(inference={"weight_dtype": "int8"}), progress=False)
    assert seen_while_quantizing == [([], False)]  # drawn, not yet written while the engine built
    assert engine.cache_writes.queued == [] and len(engine.cache_writes.started) == 2  # weights and int8: started
    engine.cache_writes.wait()
    assert random_weights_path(small_config(layers=3).model, torch.float32).exists()

    class Failed(Exception):
        pass

    def fail(*args, **kwargs):
        raise Failed

    monkeypatch.setattr("kvbook.runtime.engine.quant.quantize_model", fail)
    with pytest.raises(Failed):  # an engine that fails after drawing still caches what it drew
        Engine(small_config(layers=1).replace(inference={"weight_dtype": "int8"}), progress=False)
    for thread in _saving():
        thread.join()
    assert random_weights_path(small_config(layers=1).model, torch.float32).exists()
