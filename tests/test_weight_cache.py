"""A first run draws the random weights and caches them while the model is already in use. Whatever it reports
must belong to the call that asked (in a notebook: the cell that created the Engine), not to whatever runs when
the background write finishes."""

import logging

import torch
from kvbook.model.weights import load_random_weights, random_weights_path, wait_for_saves

from .conftest import small_config


def test_a_first_run_reports_caching_in_the_calling_thread_and_nothing_afterwards(weight_cache, capfd, caplog):
    cfg = small_config().model
    with caplog.at_level(logging.INFO, logger="kvbook.model.weights"):
        load_random_weights(cfg, torch.float32, progress=True)
        said_by_the_call = capfd.readouterr().err
        wait_for_saves()
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
        weights, _ = load_random_weights(cfg, torch.float32, progress=False)
        wait_for_saves()
    assert weights  # the model still got its weights
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "could not cache weights" in caplog.records[0].getMessage()
    assert capfd.readouterr().err == ""  # no thread traceback
