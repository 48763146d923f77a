"""Pictures of the ideas, drawn from the configuration: the decoder layer with its shapes, the prefill/decode
timeline, the KV append, the paged block table, RoPE's rotations and the tensor-parallel split. Each function
returns a small matplotlib Figure whose labels are computed from its arguments (a ModelConfig, lengths, block
tables), so the pictures follow config.toml.

Used in chapters 1 ("The pipeline"), 3 ("Inside layer 0"), 5a ("Inference from scratch"), 9 ("Memory"), 14
("Attention in real models") and 15 ("Two devices").
"""

from __future__ import annotations

import itertools
import math

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyBboxPatch, Rectangle

from ..config import ModelConfig
from ..model.rope import rope_cos_sin, rotate_half

PREFILL_COLOR = "#9ecae1"
DECODE_COLOR = "#fdae6b"
NORM_COLOR = "#e5e5e5"
MLP_COLOR = "#c7e9c0"
OTHER_COLOR = "#dadaeb"


def _box(ax, x, y, width, height, text, color, fontsize=8):
    ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.02",
                                facecolor=color, edgecolor="0.3", linewidth=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, label="", fontsize=7, label_side=1):
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": "0.3", "linewidth": 0.8})
    if label:
        middle = ((start[0] + end[0]) / 2 + 0.08 * label_side, (start[1] + end[1]) / 2)
        ax.text(*middle, label, ha="left" if label_side > 0 else "right", va="center", fontsize=fontsize,
                color="0.15")


def _bare(ax):
    ax.set_axis_off()
    ax.grid(False)


def shape(*dims) -> str:
    """'[1, 256, 4096]' from (1, 256, 4096)."""
    return "[" + ", ".join(str(d) for d in dims) + "]"


def layer_diagram(cfg: ModelConfig, tokens: int, figsize=(6.4, 6.4)):
    """One decoder layer as a block diagram, bottom to top, with the tensor shape on every arrow for a
    sequence of `tokens` positions (batch 1)."""
    hidden, heads, kv_heads, head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fig, ax = plt.subplots(figsize=figsize)
    _bare(ax)
    ax.set_xlim(-3.2, 3.2)
    ax.set_ylim(-0.6, 11.6)
    x_main, width, height = 0.0, 2.6, 0.55
    rows = [  # (y, text, color)
        (0.9, "RMSNorm (input_layernorm)", NORM_COLOR),
        (2.6, "Q, K: q_norm, k_norm, RoPE (V as is)", NORM_COLOR),
        (3.9, "attention: softmax(Q K\u1d40 / \u221a" + f"{head_dim}" + " + mask) V", OTHER_COLOR),
        (5.2, f"o_proj ({heads * head_dim} \u2192 {hidden})", OTHER_COLOR),
        (6.5, "\u2295 residual add", "white"),
        (7.4, "RMSNorm (post_attention_layernorm)", NORM_COLOR),
        (9.1, "SiLU(gate) \u00d7 up", MLP_COLOR),
        (10.2, f"down_proj ({cfg.intermediate_size} \u2192 {hidden})", MLP_COLOR),
        (11.2, "\u2295 residual add", "white"),
    ]
    for y, text, color in rows:
        _box(ax, x_main, y, width, height * (0.8 if "\u2295" in text else 1), text, color)
    # Q, K, V projections side by side
    for x, name in ((-1.0, "q_proj"), (0.0, "k_proj"), (1.0, "v_proj")):
        _box(ax, x, 1.75, 0.85, 0.45, name, OTHER_COLOR, fontsize=7)
        _arrow(ax, (x, 1.15), (x, 1.52))
    # gate and up side by side
    for x, name in ((-0.7, "gate_proj"), (0.7, "up_proj")):
        _box(ax, x, 8.25, 1.2, 0.45, name, MLP_COLOR, fontsize=7)
        _arrow(ax, (x, 7.65), (x, 8.02))
        _arrow(ax, (x, 8.48), (x, 8.82))
    seq = shape(1, tokens, hidden)
    ax.text(1.4, 8.25, shape(1, tokens, cfg.intermediate_size) + " each", va="center", fontsize=7, color="0.15")
    _arrow(ax, (x_main, -0.5), (x_main, 0.62), "x " + seq)
    _arrow(ax, (0, 1.98), (0, 2.32),
           f"Q {shape(1, tokens, heads, head_dim)}, K, V {shape(1, tokens, kv_heads, head_dim)}")
    _arrow(ax, (0, 2.88), (0, 3.62),
           f"Q {shape(1, heads, tokens, head_dim)}, K, V {shape(1, kv_heads, tokens, head_dim)}")
    _arrow(ax, (0, 4.18), (0, 4.92), f"heads side by side {shape(1, tokens, heads * head_dim)}")
    _arrow(ax, (0, 5.48), (0, 6.28), seq)
    _arrow(ax, (0, 6.72), (0, 7.12), seq)
    _arrow(ax, (0, 9.38), (0, 9.92), shape(1, tokens, cfg.intermediate_size))
    _arrow(ax, (0, 10.48), (0, 11.0), seq)
    # the two residual connections, on the left
    for start, end in ((0.0, 6.5), (6.8, 11.2)):
        ax.plot([0, -2.6, -2.6, -1.3], [start, start, end, end], color="0.5", linewidth=0.8)
    ax.text(-2.7, 3.2, "residual " + seq, rotation=90, ha="right", va="center", fontsize=7, color="0.3")
    ax.set_title(f"One decoder layer, {tokens} positions: hidden {hidden}, {heads} heads of {head_dim}, "
                 f"intermediate {cfg.intermediate_size}", fontsize=9)
    fig.tight_layout()
    return fig


def timeline_diagram(input_len: int, decode_steps: int, ttft_ms: float | None = None,
                     tpot_ms: float | None = None, figsize=(6.4, 2.0)):
    """One request on a time axis: a prefill block of input_len positions, then one block per decode step.
    With measured ttft_ms and tpot_ms the axis is in milliseconds; without, the durations are schematic."""
    measured = ttft_ms is not None and tpot_ms is not None
    prefill, step = (ttft_ms, tpot_ms) if measured else (4.0, 1.0)
    fig, ax = plt.subplots(figsize=figsize)
    ax.grid(False)
    ax.add_patch(Rectangle((0, 0), prefill, 1, facecolor=PREFILL_COLOR, edgecolor="0.3"))
    ax.text(prefill / 2, 0.5, f"prefill\n{input_len} positions\n\u2192 token 1", ha="center", va="center",
            fontsize=8)
    end = prefill + decode_steps * step
    # Each box is labelled with the token its step gives (step 1 gives token 2); where boxes are narrower than a
    # label, every k-th box is, so that the numbers never run into each other.
    box_points = figsize[0] * 72 * 0.9 * step / (end * 1.02)  # the axes take about 90% of the figure's width
    label_points = 0.65 * 7 * len(str(decode_steps + 1)) + 2  # a 7-point digit is about 0.65 x 7 points wide
    every = math.ceil(label_points / box_points)
    for i in range(decode_steps):
        start = prefill + i * step
        ax.add_patch(Rectangle((start, 0), step, 1, facecolor=DECODE_COLOR, edgecolor="0.3"))
        if i % every == 0:
            ax.text(start + step / 2, 0.5, f"{i + 2}", ha="center", va="center", fontsize=7)
    for x0, x1, label in ((0, prefill, "TTFT"), (prefill, prefill + step, "TPOT")):
        ax.annotate("", xy=(x1, 1.25), xytext=(x0, 1.25), arrowprops={"arrowstyle": "<->", "linewidth": 0.8})
        ax.text((x0 + x1) / 2, 1.35, label, ha="center", va="bottom", fontsize=8)
    ax.text(prefill + decode_steps * step / 2, -0.35,
            f"{decode_steps} decode steps, 1 position each, marked with the token each gives",
            ha="center", va="top", fontsize=8)
    ax.set_xlim(0, end * 1.02)
    ax.set_ylim(-0.9, 1.9)
    ax.set_yticks([])
    if not measured:
        ax.set_xticks([])
    ax.set_xlabel("time (ms)" if measured else "time (schematic: decode steps drawn much longer than they are)")
    ax.set_title("One request: token 1 comes out of prefill, every later token out of one decode step", fontsize=9)
    fig.tight_layout()
    return fig


def kv_append_diagram(cfg: ModelConfig, prompt_len: int, decode_steps: int, figsize=(6.4, 2.6)):
    """Every layer's K and V cache after prefill and decode_steps steps: the prompt's block of positions, and one
    new column per step and per layer. The prompt block is drawn narrow; each appended column is one position."""
    layers, kv_heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    block = 6.0  # drawn width of the prompt's positions
    fig, ax = plt.subplots(figsize=figsize)
    _bare(ax)
    rows = [(layer, kind) for layer in range(layers) for kind in ("K", "V")]
    for row, (layer, kind) in enumerate(reversed(rows)):
        ax.add_patch(Rectangle((0, row), block, 0.8, facecolor=PREFILL_COLOR, edgecolor="0.3", linewidth=0.6))
        if row == len(rows) - 1:
            ax.text(block / 2, row + 1.0, f"positions 0-{prompt_len - 1} (prefill)", ha="center", fontsize=7)
        ax.text(-0.2, row + 0.4, f"layer {layer} {kind}", ha="right", va="center", fontsize=7)
        for step in range(decode_steps):
            ax.add_patch(Rectangle((block + step, row), 1, 0.8, facecolor=DECODE_COLOR, edgecolor="0.3",
                                   linewidth=0.6))
    for step in range(decode_steps):
        ax.text(block + step + 0.5, len(rows) + 0.05, f"{step + 1}", ha="center", fontsize=7)
    ax.text(block + decode_steps / 2, len(rows) + 0.55, "decode step", ha="center", fontsize=7)
    final = shape(1, kv_heads, prompt_len + decode_steps, head_dim)
    ax.text(block + decode_steps + 0.4, len(rows) / 2, f"each: {final}\nafter {decode_steps} steps",
            va="center", fontsize=8)
    ax.set_xlim(-2.6, block + decode_steps + 5.5)
    ax.set_ylim(-0.3, len(rows) + 1.3)
    ax.set_title(f"The KV append: {layers} layers x (K, V), one new position per step in every layer", fontsize=9)
    fig.tight_layout()
    return fig


def block_table_diagram(block_table: list[int], cache_len: int, block_size: int,
                        other_blocks: list[int] = (), figsize=(6.4, 2.6)):
    """A paged sequence: its logical blocks (top row, in order) point through the block table to physical
    blocks of the pool (bottom row). other_blocks: blocks of the pool held by other sequences (grey)."""
    held = sorted(set(block_table) | set(other_blocks))
    first, last = held[0], held[-1]
    pool = list(range(first, last + 1))
    fig, ax = plt.subplots(figsize=figsize)
    _bare(ax)
    column = {block: i for i, block in enumerate(pool)}
    spacing = max(len(pool), len(block_table)) / max(len(block_table), 1)
    for logical, physical in enumerate(block_table):
        filled = min(block_size, cache_len - logical * block_size)
        x = logical * spacing
        ax.add_patch(Rectangle((x, 2), 0.9, 0.7, facecolor=DECODE_COLOR if filled < block_size else PREFILL_COLOR,
                               edgecolor="0.3", linewidth=0.6))
        ax.text(x + 0.45, 2.35, str(logical), ha="center", va="center", fontsize=7)
        ax.annotate("", xy=(column[physical] + 0.45, 0.75), xytext=(x + 0.45, 2.0),
                    arrowprops={"arrowstyle": "->", "color": "0.4", "linewidth": 0.6})
    for block in pool:
        color = PREFILL_COLOR if block in block_table else ("0.8" if block in other_blocks else "white")
        ax.add_patch(Rectangle((column[block], 0), 0.9, 0.7, facecolor=color, edgecolor="0.3", linewidth=0.6))
        ax.text(column[block] + 0.45, 0.35, str(block), ha="center", va="center", fontsize=7)
    ax.text(-0.3, 2.35, "logical", ha="right", va="center", fontsize=8)
    ax.text(-0.3, 0.35, "physical", ha="right", va="center", fontsize=8)
    partial = cache_len - (len(block_table) - 1) * block_size
    ax.set_title(f"Block table: {cache_len} positions in {len(block_table)} blocks of {block_size} "
                 f"(last one holds {partial}); grey = another sequence", fontsize=9)
    ax.set_xlim(-2.2, len(pool) + 0.2)
    ax.set_ylim(-0.2, 3.0)
    fig.tight_layout()
    return fig


def rope_periods(cfg: ModelConfig) -> list[float]:
    """Positions per full turn of each of RoPE's head_dim / 2 rotation pairs: 2 pi / theta^(-2i / head_dim)."""
    return [2 * math.pi * cfg.rope_theta ** (2 * i / cfg.head_dim) for i in range(cfg.head_dim // 2)]


def rope_diagram(cfg: ModelConfig, positions: int = 64, pairs: tuple[int, ...] = (0, 8, 16, 32),
                 distances: int = 256, query_positions: tuple[int, ...] = (255, 2047), seed: int = 0,
                 figsize=(7.6, 3.0)):
    """RoPE drawn from the model's own rotation (kvbook.model.rope). Left: cos of the angle by which each of a few
    pairs of a head's dimensions turns, against the position (pair 0 turns fastest). Right: the score q . k of one
    (q, k) pair of random vectors, rotated to their positions, against the distance between them, for queries at
    several positions: the curves coincide, because the score depends only on the distance."""
    periods = rope_periods(cfg)
    fig, (ax_turn, ax_score) = plt.subplots(1, 2, figsize=figsize)
    steps = torch.arange(positions)
    for pair in pairs:
        angle = steps.double() * 2 * math.pi / periods[pair]
        ax_turn.plot(steps, torch.cos(angle), linewidth=0.9,
                     label=f"pair {pair}: a turn per {periods[pair]:,.0f} positions")
    ax_turn.set_xlabel("position")
    ax_turn.set_ylabel("cos(angle)")
    ax_turn.set_title(f"{cfg.head_dim // 2} pairs of a {cfg.head_dim}-dim head, theta = {cfg.rope_theta:g}",
                      fontsize=9)
    ax_turn.set_ylim(-1.1, 1.9)
    ax_turn.legend(fontsize=6, loc="upper right", ncols=2)
    generator = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, cfg.head_dim, generator=generator, dtype=torch.float64)
    distances = torch.arange(min(distances, min(query_positions) + 1))
    for position, style in zip(query_positions, itertools.cycle(["-", "--", ":", "-."])):
        cos, sin = rope_cos_sin(torch.tensor([position]), cfg.head_dim, cfg.rope_theta, torch.float64)
        q_rotated = q * cos[0] + rotate_half(q) * sin[0]
        cos, sin = rope_cos_sin(position - distances, cfg.head_dim, cfg.rope_theta, torch.float64)
        k_rotated = k * cos + rotate_half(k) * sin  # [distances, head_dim]
        ax_score.plot(distances, k_rotated @ q_rotated, style, linewidth=1.2, label=f"query at position {position}")
    ax_score.set_xlabel("query position - key position")
    ax_score.set_ylabel("q . k")
    ax_score.set_title("one (q, k) pair's score: a function of the distance", fontsize=9)
    ax_score.legend(fontsize=6)
    fig.tight_layout()
    return fig


def tensor_parallel_diagram(cfg: ModelConfig, world_size: int = 2, figsize=(7.6, 5.4)):
    """A decoder layer split over world_size ranks (kvbook.model.tensor_parallel), bottom to top: each rank's
    column holds its heads, its K/V cache and its slice of the MLP; the two all-reduces per layer span the ranks;
    the embedding and lm_head are whole on every rank. Sizes from the config, per rank."""
    heads, kv_heads = cfg.num_attention_heads // world_size, cfg.num_key_value_heads // world_size
    width, hidden, d = cfg.intermediate_size // world_size, cfg.hidden_size, cfg.head_dim
    fig, ax = plt.subplots(figsize=figsize)
    _bare(ax)
    ax.set_xlim(-0.1, 3.1 * world_size - 0.3)
    ax.set_ylim(-0.9, 8.9)
    rows = [  # (y, text of rank r, colour)
        (0, lambda r: f"embed_tokens: all {cfg.vocab_size:,} rows", NORM_COLOR),
        (1.2, lambda r: f"q/k/v_proj: query heads {r * heads}-{(r + 1) * heads - 1}\n"
                        f"[T, {hidden}] -> [T, {heads * d}], 2 x [T, {kv_heads * d}]", OTHER_COLOR),
        (2.4, lambda r: f"attention over {heads} heads\nK/V cache [1, {kv_heads}, T, {d}]", PREFILL_COLOR),
        (3.6, lambda r: f"o_proj: [T, {heads * d}] -> [T, {hidden}]\na partial sum", OTHER_COLOR),
        (5.4, lambda r: f"gate/up_proj: columns {r * width}-{(r + 1) * width - 1}\n"
                        f"[T, {hidden}] -> [T, {width}]", MLP_COLOR),
        (6.6, lambda r: f"down_proj: [T, {width}] -> [T, {hidden}]\na partial sum", MLP_COLOR),
        (8.4, lambda r: f"lm_head: all {cfg.vocab_size:,} rows", NORM_COLOR),
    ]
    for rank in range(world_size):
        x = 1.35 + 3.1 * rank
        ax.text(x, -0.75, f"rank {rank}", ha="center", fontsize=9, weight="bold")
        for y, text, color in rows:
            _box(ax, x, y, 2.7, 0.8, text(rank), color, fontsize=7)
    reduce = f"all-reduce: each rank gets the sum of the {world_size} partial [T, {hidden}]"
    for y in (4.5, 7.5):  # across every column
        _box(ax, 1.35 + 1.55 * (world_size - 1), y, 3.1 * (world_size - 1) + 2.7, 0.45, reduce, DECODE_COLOR,
             fontsize=7)
    ax.set_title(f"one of {cfg.num_hidden_layers} layers on {world_size} ranks (T new positions)", fontsize=9)
    fig.tight_layout()
    return fig


def figure_texts(fig) -> list[str]:
    """Every text drawn in a figure (titles, labels, annotations): what the tests and the chapters check."""
    from matplotlib.text import Text

    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]
