"""A first run draws the random weights and caches them while the model is already in use. Whatever it reports
must belong to the call that asked (in a notebook: the cell that created the Engine), not to whatever runs when
the background write finishes."""

import io
import logging
import threading

import pytest
import torch
from kvbook.model.weights import load_random_weights, random_weights_path, saves_held, wait_for_saves
from kvbook.runtime.engine import Engine
from safetensors.torch import load_file, save_file

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


def _saving() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("save ")]


def test_writes_asked_for_while_an_engine_builds_start_once_the_model_is_whole(weight_cache, monkeypatch):
    cfg = small_config().model
    path = random_weights_path(cfg, torch.float32)
    with saves_held():
        load_random_weights(cfg, torch.float32, progress=False)
        with saves_held():  # nested: the outer block starts the writes
            pass
        assert _saving() == [] and not path.exists()  # asked for, not started: the CPUs keep building
        wait_for_saves()  # waits for started writes only: nothing here to wait for, and no error
        assert not path.exists()
    wait_for_saves()
    assert path.exists()

    class Failed(Exception):
        pass

    def fail(*args, **kwargs):
        raise Failed

    monkeypatch.setattr("kvbook.runtime.engine.quant.quantize_model", fail)
    with pytest.raises(Failed):  # an engine that fails after drawing still caches what it drew
        Engine(small_config(layers=1).replace(inference={"weight_dtype": "int8"}), progress=False)
    wait_for_saves()
    assert random_weights_path(small_config(layers=1).model, torch.float32).exists()


def test_a_sparsely_read_tensor_is_read_whole_once_from_its_own_bytes(tmp_path, monkeypatch):
    # the embedding's rows are read one per decode step; read_into_page_cache reads its bytes of the file in blocks
    from kvbook.model import weights

    tensors = {"before": torch.arange(1000, dtype=torch.float16), "table": torch.randn(300, 7),
               "after": torch.ones(5, dtype=torch.int8)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    read = []

    class Spy(io.FileIO):
        def readinto(self, buffer):
            count = super().readinto(buffer)
            read.append(bytes(buffer[:count]))
            return count

    monkeypatch.setattr(weights, "open", lambda p, mode, buffering: Spy(p, "r"), raising=False)
    monkeypatch.setattr(weights, "READ_BLOCK", 1000)  # several blocks for the table's 8400 bytes
    weights.read_into_page_cache(path, ("table",))
    assert len(read) == 9 and b"".join(read) == tensors["table"].numpy().tobytes()


def _mapped_files(tensor: torch.Tensor) -> list[str]:
    """The files whose mapping (Linux's /proc/self/maps) holds the tensor's first byte."""
    address, files = tensor.data_ptr(), []
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= address < end and len(fields) > 5:
            files.append(fields[5])
    return files


def test_read_tensors_reads_a_file_into_memory_of_its_own(tmp_path, monkeypatch):
    # the matrices a decode step streams are read in, not mapped (4 KiB pages of the page cache were slower)
    from kvbook.model import weights

    tensors = {"f16": torch.randn(3, 5).half(), "bf16": torch.randn(700, 9).bfloat16(), "f32": torch.randn(4),
               "i8": torch.randint(-127, 128, (6, 3), dtype=torch.int8)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    monkeypatch.setattr(weights, "READ_BLOCK", 1000)  # bf16's 12600 bytes in several blocks
    read = weights.read_tensors(path)
    assert read.keys() == tensors.keys()
    assert all(read[k].dtype == t.dtype and torch.equal(read[k], t) for k, t in tensors.items())
    mapped = load_file(str(path))  # safetensors' own loader maps the file
    assert str(path) in _mapped_files(mapped["bf16"]) and not any(str(path) in _mapped_files(t) for t in read.values())
    path.write_bytes(path.read_bytes()[:-10])  # a file cut short: one line naming it and the fix
    with pytest.raises(OSError, match="shorter than its header says; delete it"):
        weights.read_tensors(path)


def test_an_engine_reads_in_the_prefill_copy_its_decode_steps_stream_and_maps_it_otherwise(weight_cache, monkeypatch):
    from kvbook.runtime.paths import fixed_paths

    # the copy as loaded: not laid out for oneDNN (which replaces prefill's own copy where a CPU allows it)
    monkeypatch.setattr("kvbook.runtime.engine.reorders_prefill_copy", lambda *args: False)
    cfg = small_config(dtype="float16")
    Engine(cfg, progress=False, paths=fixed_paths(torch.bfloat16, torch.float16, torch.float16))  # draws, writes
    wait_for_saves()

    def q_proj_copy(decode: torch.dtype) -> torch.Tensor:
        engine = Engine(cfg, progress=False, paths=fixed_paths(torch.bfloat16, decode, decode))  # from the cache
        return engine.model.model.layers[0].self_attn.q_proj.copies[torch.bfloat16]

    prefill_copy = next(weight_cache.glob("*.prefill-bfloat16.safetensors"))
    assert str(prefill_copy) in _mapped_files(q_proj_copy(torch.float16))  # prefill's alone: mapped
    assert str(prefill_copy) not in _mapped_files(q_proj_copy(torch.bfloat16))  # decode streams it too: read in
