"""Tensor parallelism, the processes: N ranks started by torch.multiprocessing, each with its slice of the model
(kvbook.model.tensor_parallel) and of every KV cache, each running the same scheduler loop. They keep in step
because every all-reduce of the model waits for all of them; rank 0 samples each token and broadcasts it.
Explained in chapter 15 ("Two devices").

gloo on CPUs, NCCL on GPUs (rank r on cuda:r). Every collective has a timeout, and the launcher watches the
processes: when a rank dies or fails, torch stops the others and the caller gets one line naming the rank.

    run = ranks.generate(config, prompt, world_size=2, max_new_tokens=8)

A rank runs one of this module's work functions (a function a spawned process can import: rank_facts,
prefill_logits, decode_step_ms, generate_on_rank): work(engine, send, *args) -> a result, collected from every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import Config, ConfigError
from ..device import TORCH_DTYPES, resolve_device, synchronize
from ..model.tensor_parallel import rank_config, shard_weights
from ..model.weights import build_model, checkpoint_config, load_checkpoint, load_random_weights
from .engine import Engine
from .scheduler import Scheduler
from .sequence import Generation


class RankError(ChildProcessError):
    """A rank died or failed; the others were stopped."""


class RankScheduler(Scheduler):
    """The scheduler loop of one rank: rank 0 draws the tokens, every rank takes them."""

    def _sample(self, logits, batch) -> list[int]:
        tokens = super()._sample(logits, batch) if dist.get_rank() == 0 else [0] * len(batch)
        shared = torch.tensor(tokens, device=self.engine.device)
        dist.broadcast(shared, src=0)
        return shared.tolist()


def check_world_size(world_size: int, device: torch.device) -> None:
    """Refuse a number of ranks this machine cannot give each one a device (a GPU, or a CPU core) for."""
    if world_size < 1:
        raise ConfigError(f"tensor parallel {world_size}: must be >= 1")
    available = torch.cuda.device_count() if device.type == "cuda" else len(os.sched_getaffinity(0))
    what = "GPUs" if device.type == "cuda" else "CPU cores"
    if world_size > available:
        raise ConfigError(f"tensor parallel {world_size}: this machine has {available} {what}; each rank needs one")


def launch(config: Config, world_size: int, work, *args, checkpoint: str | None = None, timeout_s: float = 120.0,
           on_message=None, progress: bool = True) -> list:
    """Start world_size ranks, each building its engine and running work(engine, send, *args) -> every rank's
    result, rank 0's first. send(*payload) from a rank calls on_message(rank, payload) here, as it comes.
    timeout_s bounds every collective: a rank left waiting on a peer that stopped answering fails after it."""
    device = resolve_device(config.inference.device)  # its notice (no CUDA here) once, not once per rank
    config = config.replace(inference={"device": device.type})
    check_world_size(world_size, device)
    rank_config(config.model, world_size)  # a split that does not divide fails here, before any process starts
    if checkpoint is None:  # draw the weights once, here, if no cache has them: the ranks then map the same file
        load_random_weights(config.model, TORCH_DTYPES[config.inference.dtype], progress)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # our RankError says it in one line
    context = mp.get_context("spawn")
    messages = context.SimpleQueue()
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvbook-ranks-") as rendezvous:
        ranks = mp.spawn(_rank_main, args=(world_size, config, checkpoint, Path(rendezvous) / "init", timeout_s,
                                           messages, work, args), nprocs=world_size, join=False)
        try:
            while not _joined(ranks):
                _deliver(messages, results, on_message)
            _deliver(messages, results, on_message)
        finally:
            for process in ranks.processes:  # only if the caller was interrupted: join stops them on failure
                if process.is_alive():
                    process.terminate()
                process.join()
    return [results[rank] for rank in range(world_size)]


def _joined(ranks) -> bool:
    """Wait a moment for the ranks -> whether all ended well; a rank that died or raised -> RankError."""
    try:
        return ranks.join(timeout=0.1)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as err:
        raise RankError(_first_cause(ranks.processes, err)) from None


def _first_cause(processes, err) -> str:
    """What ended the run. A rank killed by a signal makes its peers fail in their next collective, and either
    may be the one torch reports; the killed one is the cause (torch stops the others with SIGTERM)."""
    for rank, process in enumerate(processes):
        if process.exitcode is not None and process.exitcode < 0 and -process.exitcode != signal.SIGTERM:
            return (f"tensor parallel: rank {rank} died (killed by {signal.Signals(-process.exitcode).name}); "
                    "the other ranks were stopped")
    if isinstance(err, mp.ProcessRaisedException):
        last = str(err).strip().splitlines()[-1]  # the exception's own line, e.g. "ValueError: ..."
        return f"tensor parallel: rank {err.error_index} failed: {last}"
    how = f"killed by {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
    return f"tensor parallel: rank {err.error_index} died ({how}); the other ranks were stopped"


def _deliver(messages, results: dict, on_message) -> None:
    while not messages.empty():
        kind, rank, payload = messages.get()
        if kind == "result":
            results[rank] = payload
        elif on_message is not None:
            on_message(rank, payload)


def _rank_main(rank, world_size, config, checkpoint, init_file, timeout_s, messages, work, args) -> None:
    """One rank's process: its device and threads, the process group, its engine, the work."""
    device = resolve_device(config.inference.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))  # the cores shared out
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        started = time.perf_counter()
        dtype = TORCH_DTYPES[config.inference.dtype]
        if checkpoint is None:
            model_cfg, weights = config.model, load_random_weights(config.model, dtype, progress=False)
        else:
            model_cfg = checkpoint_config(checkpoint)
            weights = load_checkpoint(checkpoint, model_cfg, dtype)
        own = rank_config(model_cfg, world_size)
        # CUDA graphs would capture the all-reduces too: a rank decodes eagerly
        rank_cfg = dataclasses.replace(config, model=own).replace(inference={"device": str(device),
                                                                             "cuda_graphs": False})
        engine = Engine(rank_cfg, model=build_model(own, shard_weights(weights, rank, world_size), device),
                        progress=False)
        synchronize(device)
        messages.put(("message", rank, ("ready", {"pid": os.getpid(), "ready_s": time.perf_counter() - started})))
        result = work(engine, lambda *payload: messages.put(("message", rank, payload)), *args)
        messages.put(("result", rank, result))
    finally:
        dist.destroy_process_group()


# ---- work functions: what a rank can be asked to do ---------------------------------------------------------

def rank_facts(engine, send, prompt: list[int]) -> dict:
    """This rank's heads, MLP width, weight bytes and its KV cache after a prefill of prompt."""
    cache = engine.new_cache()
    engine.prefill(cache, prompt)
    m = engine.config.model
    facts = {"rank": dist.get_rank(), "query heads": m.num_attention_heads, "K/V heads": m.num_key_value_heads,
             "MLP width": m.intermediate_size, "K cache": list(cache.layers[0].keys().shape),
             "cache bytes": cache.filled_bytes(), "weight bytes": sum(p.nbytes for p in engine.model.parameters())}
    engine.release_cache(cache)
    return facts


def prefill_logits(engine, send, prompt: list[int]):
    """The logits of the prompt's last position after its prefill, a float32 numpy array [1, 1, vocab] (sent by
    value: a tensor would go through shared memory, which the rank's exit takes away)."""
    cache = engine.new_cache()
    logits, _ = engine.prefill(cache, prompt)
    engine.release_cache(cache)
    return logits.float().cpu().numpy()


def decode_step_ms(engine, send, prompt: list[int], steps: int) -> list[float]:
    """The milliseconds of each of `steps` decode steps after a prefill of prompt (greedy, fed its own tokens)."""
    cache = engine.new_cache()
    logits, _ = engine.prefill(cache, prompt)
    token, times = int(logits[0, -1].argmax()), []
    for _ in range(steps):
        started = time.perf_counter()
        logits = engine.decode([token], [cache])
        synchronize(engine.device)
        times.append((time.perf_counter() - started) * 1e3)
        token = int(logits[0, -1].argmax())
    engine.release_cache(cache)
    return times


def generate_on_rank(engine, send, prompt: list[int], options: dict) -> Generation:
    """One request through this rank's scheduler loop; rank 0 sends each token as it comes."""
    scheduler = RankScheduler(engine, max_num_seqs=1)
    seq = scheduler.add(prompt, **options)
    while not seq.finished:
        for done in scheduler.step():
            if done.error is None and dist.get_rank() == 0:
                send("token", done.steps[-1].token_id)
    if seq.error is not None:
        raise seq.error
    return seq.generation()


def generate(config: Config, prompt: list[int], world_size: int, checkpoint: str | None = None, on_message=None,
             progress: bool = True, **options) -> Generation:
    """Generate with world_size ranks -> rank 0's Generation (options: Engine.generate's). Every rank must have
    produced the same tokens."""
    runs = launch(config, world_size, generate_on_rank, prompt, options, checkpoint=checkpoint,
                  on_message=on_message, progress=progress)
    differing = [rank for rank, run in enumerate(runs) if run.output_ids != runs[0].output_ids]
    if differing:
        raise RankError(f"tensor parallel: ranks {differing} produced other tokens than rank 0")
    return runs[0]
