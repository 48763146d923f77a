"""What the chapters show: parameter tables, plots, and the decode-step scrubber (a live ipywidgets one for a
running kernel, a matplotlib animation with a slider for the rendered book, which has no kernel).

Every figure is made from a real run recorded by kvbook.trace.Tracer; nothing here computes the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pandas as pd
import torch

from .config import DTYPE_BYTES, Config, ModelConfig, load_config

matplotlib.rcParams.update({"figure.dpi": 72, "figure.figsize": (6.4, 3.2), "axes.grid": True, "grid.alpha": 0.3})


def config_path() -> Path:
    """config.toml of the repository the notebook runs in (found from the current directory upwards)."""
    for directory in [Path.cwd(), *Path.cwd().parents]:
        if (directory / "config.toml").is_file():
            return directory / "config.toml"
    raise FileNotFoundError("no config.toml in this directory or above it; start Jupyter in the kvbook repository")


def book_config(*overrides: str) -> Config:
    """The repository's config.toml with --set style overrides, e.g. book_config("kv_cache.enable=false")."""
    return load_config(config_path(), list(overrides))


# ---- chapter 1: parameters and memory ------------------------------------------------------------------------

def parameter_table(model: torch.nn.Module) -> pd.DataFrame:
    """Parameters per part of the model, counted from the model's own tensors (a tied lm_head counts once)."""
    parts: dict[str, int] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        if name.startswith("model.layers."):
            part = "layer " + name.split(".")[2]
        else:
            part = {"model.embed_tokens.weight": "embedding", "model.norm.weight": "final norm",
                    "lm_head.weight": "lm_head"}[name]
        parts[part] = parts.get(part, 0) + param.numel()
    table = pd.DataFrame({"part": list(parts), "parameters": list(parts.values())})
    table.loc[len(table)] = ["total", table["parameters"].sum()]
    table["millions"] = (table["parameters"] / 1e6).round(1)
    return table


def weight_memory_table(parameters: int) -> pd.DataFrame:
    """Bytes of weights per dtype for a parameter count."""
    return pd.DataFrame({"dtype": list(DTYPE_BYTES), "bytes per parameter": list(DTYPE_BYTES.values()),
                         "GiB": [round(parameters * size / 2**30, 2) for size in DTYPE_BYTES.values()]})


# ---- a recorded decode run ------------------------------------------------------------------------------------

@dataclass
class DecodeRecording:
    """What the scrubber shows, per generated token: attention over all positions for each layer and head, the
    cache length, the top-5 next tokens with probabilities, and the step's latency."""

    steps: pd.DataFrame  # Tracer.steps
    attention: dict  # (step, layer) -> [heads, T, S]
    logits: dict  # step -> [vocab]
    prompt_len: int
    num_layers: int
    num_heads: int

    @classmethod
    def from_tracer(cls, tracer, model_cfg: ModelConfig) -> DecodeRecording:
        if not tracer.attention or not tracer.logits:
            raise ValueError("record the run with Tracer(model, record_attention=True, record_logits=True)")
        steps = tracer.steps
        return cls(steps, tracer.attention, tracer.logits, int(steps["prompt_len"].iloc[0]),
                   model_cfg.num_hidden_layers, model_cfg.num_attention_heads)

    def attention_row(self, step: int, layer: int, head: int) -> torch.Tensor:
        """The attention weights of the newest position over every cached position: [S]."""
        return self.attention[(step, layer)][head, -1]

    def top_tokens(self, step: int, tokenizer, k: int = 5) -> pd.DataFrame:
        probs = torch.softmax(self.logits[step], dim=-1)
        values, ids = probs.topk(k)
        return pd.DataFrame({"token_id": ids.tolist(), "text": [repr(tokenizer.token_text(i)) for i in ids.tolist()],
                             "probability": [round(v, 4) for v in values.tolist()]})


# ---- plots ------------------------------------------------------------------------------------------------

def plot_cache_growth(steps: pd.DataFrame, model_cfg: ModelConfig, cache_dtype: str):
    """Cache length (positions) and cache bytes after each step: prefill, then one position per decode step."""
    per_position = 2 * model_cfg.num_hidden_layers * model_cfg.num_key_value_heads * model_cfg.head_dim * \
        DTYPE_BYTES[cache_dtype]
    fig, left = plt.subplots()
    left.plot(steps["step"], steps["cache_len"], marker=".", markersize=3)
    left.set_xlabel("step (0 = prefill, then one decode step per generated token)")
    left.set_ylabel("cached positions per layer")
    right = left.secondary_yaxis("right", functions=(lambda n: n * per_position / 2**20,
                                                     lambda mib: mib * 2**20 / per_position))
    right.set_ylabel(f"K + V of all layers (MiB, {cache_dtype})")
    left.set_title("The KV cache grows by one position per decode step")
    fig.tight_layout()
    return fig


def plot_step_latency(steps: pd.DataFrame, title: str = "Latency of each step"):
    fig, ax = plt.subplots()
    decode = steps[steps["phase"] == "decode"]
    ax.plot(decode["step"], decode["ms"], marker=".", markersize=3, label="decode step (TPOT)")
    ax.axhline(float(steps["ms"].iloc[0]), color="C1", linestyle="--", label="prefill (TTFT)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("milliseconds (log scale)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_attention_heatmap(weights: torch.Tensor, title: str):
    """weights [T, S]: one head's attention in prefill, the causal mask visible as the empty upper triangle."""
    fig, ax = plt.subplots(figsize=(4.2, 3.6))
    image = ax.imshow(weights.numpy(), cmap="viridis", interpolation="nearest", aspect="auto",
                      norm=matplotlib.colors.PowerNorm(0.4))
    ax.set_xlabel("key position (what is looked at)")
    ax.set_ylabel("query position")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="attention weight")
    fig.tight_layout()
    return fig


def _draw_step(ax_attention, ax_cache, recording: DecodeRecording, step: int, layer: int, head: int):
    row = recording.attention_row(step, layer, head)
    ax_attention.clear()
    ax_attention.bar(range(len(row)), row.numpy(), width=1.0, color="C0")
    ax_attention.axvline(recording.prompt_len - 0.5, color="C1", linestyle="--", linewidth=1)
    ax_attention.set_xlim(0, recording.steps["cache_len"].max())
    ax_attention.set_ylim(0, float(max(recording.attention_row(s, layer, head).max()
                                       for s in recording.steps["step"])) * 1.05)
    ax_attention.set_xlabel("cached position (dashed: end of the prompt)")
    ax_attention.set_ylabel("attention weight")
    info = recording.steps.set_index("step").loc[step]
    ax_attention.set_title(f"step {step}: layer {layer}, head {head}, attends over {len(row)} positions, "
                           f"{info['ms']:.0f} ms", fontsize=9)
    ax_cache.clear()
    ax_cache.plot(recording.steps["step"], recording.steps["cache_len"], color="0.7")
    ax_cache.plot([step], [info["cache_len"]], "o", color="C3")
    ax_cache.set_xlabel("step")
    ax_cache.set_ylabel("cache length")


def scrubber_animation(recording: DecodeRecording, layer: int = 0, head: int = 0, frames: int = 8):
    """A self-contained HTML animation with a slider over decode steps (no kernel, no network): the rendered
    book's scrubber. Few frames keep the notebook small."""
    from IPython.display import HTML
    from matplotlib.animation import FuncAnimation

    all_steps = recording.steps["step"].tolist()
    chosen = sorted({all_steps[round(i * (len(all_steps) - 1) / (frames - 1))] for i in range(frames)})
    fig, (ax_attention, ax_cache) = plt.subplots(1, 2, figsize=(7.2, 2.6), gridspec_kw={"width_ratios": [3, 1]})
    animation = FuncAnimation(fig, lambda i: _draw_step(ax_attention, ax_cache, recording, chosen[i], layer, head),
                              frames=len(chosen), interval=700)
    fig.tight_layout()
    html = _offline_jshtml(animation)
    plt.close(fig)
    return HTML(html)


def _offline_jshtml(animation) -> str:
    """matplotlib's HTML animation with a slider, minus its Font Awesome link to a CDN: the book's theme bundles
    the icons, and the book must render offline."""
    html = animation.to_jshtml(default_mode="once")
    return re.sub(r'<link rel="stylesheet"\s+href="https://[^"]*font-awesome[^"]*">', "", html)


def block_table_animation(block_tables: list[list[int]], cache_lens: list[int], block_size: int,
                          pool_blocks: int = 0, frames: int = 6):
    """The paged cache filling, as an animation with a slider: the pool's blocks as a grid, the sequence's
    blocks coloured in block-table order, the last one partly filled. block_tables[i] and cache_lens[i] are the
    sequence's block table and length after step i; the grid shows at least pool_blocks blocks."""
    from IPython.display import HTML
    from matplotlib.animation import FuncAnimation

    columns = 16
    pool_blocks = max(pool_blocks, 1 + max(max(table) for table in block_tables if table))
    rows = -(-pool_blocks // columns)
    chosen = sorted({round(i * (len(block_tables) - 1) / (frames - 1)) for i in range(frames)})
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * rows + 1.0))

    def draw(frame: int):
        i = chosen[frame]
        ax.clear()
        fill = torch.zeros(rows * columns)
        for order, block in enumerate(block_tables[i]):
            used = min(block_size, cache_lens[i] - order * block_size)
            fill[block] = used / block_size
        ax.imshow(fill.reshape(rows, columns).numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto")
        for order, block in enumerate(block_tables[i]):
            ax.text(block % columns, block // columns, str(order), ha="center", va="center", fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.grid(False)
        ax.set_title(f"step {i}: {cache_lens[i]} positions in {len(block_tables[i])} blocks of {block_size} "
                     f"(number = place in the block table)", fontsize=9)

    animation = FuncAnimation(fig, draw, frames=len(chosen), interval=700)
    fig.tight_layout()
    html = _offline_jshtml(animation)
    plt.close(fig)
    return HTML(html)


def scrubber_widget(recording: DecodeRecording, tokenizer):
    """The live scrubber: a slider over steps and selectors for layer and head (needs a running kernel)."""
    import ipywidgets as widgets
    from IPython.display import display

    steps = recording.steps["step"].tolist()
    step = widgets.IntSlider(value=steps[1] if len(steps) > 1 else 0, min=steps[0], max=steps[-1],
                             description="step")
    layer = widgets.Dropdown(options=list(range(recording.num_layers)), value=0, description="layer")
    head = widgets.Dropdown(options=list(range(recording.num_heads)), value=0, description="head")

    def show(step, layer, head):
        fig, (ax_attention, ax_cache) = plt.subplots(1, 2, figsize=(8, 2.8), gridspec_kw={"width_ratios": [3, 1]})
        _draw_step(ax_attention, ax_cache, recording, step, layer, head)
        fig.tight_layout()
        plt.show()
        display(recording.top_tokens(step, tokenizer))

    return widgets.interactive(show, step=step, layer=layer, head=head)
