"""Tensor parallelism, the model's side: which slice of each weight a rank holds, and the all-reduce that adds up
the ranks' partial outputs. Megatron-LM's split, the one vLLM and nano-vllm use. Explained in chapter 15
("Two devices"); the processes are kvbook.runtime.ranks.

With N ranks, rank r holds
- q_proj, k_proj, v_proj: the rows of its H/N query heads and KV/N K/V heads (split by output), so it computes
  attention for those heads alone and caches their K and V: [B, KV/N, S, D];
- gate_proj, up_proj: I/N of the MLP's I rows (split by output);
- o_proj, down_proj: the matching columns (split by input). Each rank's product is then a partial sum of the
  whole output, and one all-reduce per block adds the N of them: two per layer;
- everything else whole: the norms, the embedding (a lookup of one row per token) and lm_head, so that every rank
  computes the same logits from the same hidden state.

A rank's model is the plain model (kvbook.model.qwen3) built from a smaller config: rank_config.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..config import ConfigError, ModelConfig

BY_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output: rows of the [out, in] weight
BY_COLUMNS = ("o_proj", "down_proj")  # split by input: columns


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's x, in place (nothing in one process): after o_proj and after down_proj."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


def rank_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The model one of world_size ranks holds: a 1/world_size of the heads and of the MLP's width."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        count = getattr(cfg, name)
        if count % world_size:
            raise ConfigError(f"tensor parallel {world_size}: [model] {name} = {count} does not split into "
                              f"{world_size} equal parts; use a number of ranks that divides it")
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world_size,
                               num_key_value_heads=cfg.num_key_value_heads // world_size,
                               intermediate_size=cfg.intermediate_size // world_size,
                               decoupled_head_dim=True)  # H/N heads of D no longer make the hidden size


def shard_weights(weights: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """The whole model's tensors -> rank's slices. Rows are views (of an mmap: nothing read); columns are copies."""
    shard = {}
    for name, tensor in weights.items():
        kind = name.split(".")[-2]  # model.layers.0.self_attn.q_proj.weight -> q_proj
        if kind in BY_ROWS:  # heads are consecutive rows: rank r gets heads [r H/N, (r + 1) H/N)
            shard[name] = tensor.chunk(world_size, dim=0)[rank]
        elif kind in BY_COLUMNS:
            shard[name] = tensor.chunk(world_size, dim=1)[rank].contiguous()
        else:
            shard[name] = tensor
    return shard
