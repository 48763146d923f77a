"""What the chapters show: parameter tables, plots, and the decode-step scrubber (a live ipywidgets one for a
running kernel; for the rendered book, which has no kernel, the recorded data drawn by a small inline script).

Every figure is made from a real run recorded by kvbook.tools.trace.Tracer; nothing here computes the model.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pandas as pd
import torch

from ..cache.memory import DTYPE_BYTES, kv_cache_bytes
from ..config import Config, ModelConfig, load_config
from ..kernels import enable_huge_pages

matplotlib.rcParams.update({"figure.dpi": 110, "figure.figsize": (6.4, 3.2), "axes.grid": True, "grid.alpha": 0.3})


def config_path() -> Path:
    """config.toml of the repository the notebook runs in (found from the current directory upwards)."""
    for directory in [Path.cwd(), *Path.cwd().parents]:
        if (directory / "config.toml").is_file():
            return directory / "config.toml"
    raise FileNotFoundError("no config.toml in this directory or above it; start Jupyter in the kvbook repository")


def book_config(*overrides: str) -> Config:
    """The repository's config.toml with --set style overrides, e.g. book_config("kv_cache.enable=false").
    A chapter's first call: it also turns on huge pages for the weights (kvbook.kernels.enable_huge_pages)."""
    enable_huge_pages()
    return load_config(config_path(), list(overrides))


# ---- chapter 1: parameters and memory ------------------------------------------------------------------------

def tree_hash(root: Path | None = None) -> str:
    """A hash of what computes the chapters' outputs: every file under lib/kvbook, config.toml, and the chapters'
    code cells (not their outputs). A committed chapter whose stamp differs came from another tree."""
    import nbformat

    root = root or config_path().parent
    digest = hashlib.sha256()
    for path in sorted((root / "lib" / "kvbook").rglob("*.py")) + [root / "config.toml"]:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    for path in sorted((root / "chapters").glob("*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        code = "\0".join(cell.source for cell in cells if cell.cell_type == "code")
        digest.update(path.name.encode() + b"\0" + code.encode())
    return digest.hexdigest()[:16]


def machine_name() -> str:
    """The machine a run's numbers come from: the GPU, or the CPU's model name, family, model and core count."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    from .measure import _cpuinfo, cpu_model

    info = _cpuinfo()
    return (f"{cpu_model()} (CPU family {info.get('cpu family', '?')} model {info.get('model', '?')}, "
            f"{torch.get_num_threads()} cores)")


def run_stamp(chapter: str) -> dict:
    """The canonical run's stamp of one chapter (kept in the notebook's metadata, printed by the intro's chapter)."""
    import nbformat

    return nbformat.read(config_path().parent / "chapters" / chapter, as_version=4).metadata.get("kvbook", {})


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
        return pd.DataFrame({"token_id": ids.tolist(), "text": [token_label(tokenizer, i) for i in ids.tolist()],
                             "probability": [round(v, 4) for v in values.tolist()]})


def engines_table(bench: dict) -> pd.DataFrame:
    """bench --against llama.cpp's result -> one row per engine: TTFT, TPOT, their floors' ratios, start and RSS.
    kvbook and transformers read the same float16 bytes a step; each llama.cpp file has its own floor."""
    rows = {"kvbook": {**bench, "build_s": bench["ready_s"], **bench["ratios"]}}
    rows |= {f"transformers {d}": {**p, "memory_floor_ms": bench["memory_floor_ms"]}
             for d, p in bench["transformers_by_dtype"].items()}
    rows |= {p["label"]: p for p in bench.get("llama_cpp_by_type", {}).values()}
    columns = {"ttft_ms": "TTFT ms", "ttft_vs_compute_floor": "TTFT / compute floor", "tpot_ms": "TPOT ms",
               "memory_floor_ms": "memory floor ms", "tpot_vs_memory_floor": "TPOT / memory floor",
               "build_s": "ready s", "peak_rss_mb": "peak RSS MiB"}
    return pd.DataFrame({name: {label: row[key] for key, label in columns.items()}
                         for name, row in rows.items()}).T.round(2)


def token_label(tokenizer, token_id: int) -> str:
    """A token's text as Python writes it ('\\n' visible), or a note for the ids past the tokenizer's vocabulary:
    the model's 151,936 rows are padded beyond it, and random weights can rank those ids high too."""
    try:
        return repr(tokenizer.token_text(token_id))
    except KeyError:
        return "(padding id: no text)"


# ---- plots ------------------------------------------------------------------------------------------------

def plot_cache_growth(steps: pd.DataFrame, model_cfg: ModelConfig, cache_dtype: str):
    """Cache length (positions) and cache bytes after each step: prefill, then one position per decode step."""
    per_position = kv_cache_bytes(model_cfg, 1, cache_dtype)
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
    ax.grid(False)  # the book's grid (rcParams above) would draw over the weights
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


def _offline_jshtml(animation, alt: str) -> str:
    """matplotlib's HTML animation with a slider, minus its Font Awesome link to a CDN (the book's theme bundles
    the icons, and the book must render offline), its frame carrying alt text (a figure's is set in its cell's
    metadata, which does not reach HTML the cell prints)."""
    html = animation.to_jshtml(default_mode="once")
    html = html.replace('<img id="_anim_img', f'<img alt="{escape(alt)}" id="_anim_img', 1)
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
    html = _offline_jshtml(animation, "The paged KV cache filling, one frame per chosen step: the pool's blocks as "
                           "a grid, the sequence's blocks shaded by how full they are and numbered by their place "
                           "in the block table; a slider picks the step.")
    plt.close(fig)
    return HTML(html)


def scrubber_widget(recording: DecodeRecording, tokenizer):
    """The live scrubber: a slider over steps and selectors for layer and head (needs a running kernel)."""
    import ipywidgets as widgets
    from IPython.display import display

    steps = recording.steps.loc[recording.steps["phase"] == "decode", "step"].tolist()
    if not steps:
        raise ValueError("the recording has no decode step: generate at least 2 tokens")
    step = widgets.IntSlider(value=steps[0], min=steps[0], max=steps[-1], description="decode step")
    layer = widgets.Dropdown(options=list(range(recording.num_layers)), value=0, description="layer")
    head = widgets.Dropdown(options=list(range(recording.num_heads)), value=0, description="head")

    def show(step, layer, head):
        fig, (ax_attention, ax_cache) = plt.subplots(1, 2, figsize=(8, 2.8), gridspec_kw={"width_ratios": [3, 1]})
        _draw_step(ax_attention, ax_cache, recording, step, layer, head)
        fig.tight_layout()
        plt.show()
        display(recording.top_tokens(step, tokenizer))

    return widgets.interactive(show, step=step, layer=layer, head=head)


# ---- the rendered book's scrubber: the run's data in the page, drawn by a small script -------------------------

def static_scrubber(recording: DecodeRecording, tokenizer, heads: list[tuple[int, int]] | None = None,
                    top_k: int = 5):
    """The rendered book's decode-step scrubber: a slider over every decode step (1 .. last; prefill is not a
    step of it) showing each layer's cache length as text, the attention of the newest position over all cached
    positions for one of the (layer, head) pairs in heads (default: head 0 of every layer), and the top_k next
    tokens. The recorded data travel in the page as JSON (weights as one byte per position, scaled to the row's
    maximum) and a small inline script draws them: no kernel, no network, no image per step.
    """
    from IPython.display import HTML

    data = _scrubber_data(recording, tokenizer, heads, top_k)
    payload = _script_json(data)
    view_id = "kvbook-scrubber-" + hashlib.sha1(payload.encode()).hexdigest()[:12]
    options = "".join(f'<option value="{i}">layer {view["layer"]}, head {view["head"]}</option>'
                      for i, view in enumerate(data["views"]))
    first, last = data["steps"][0], data["steps"][-1]
    html = (_SCRUBBER_TEMPLATE.replace("VIEW_ID", view_id).replace("FIRST_STEP", str(first))
            .replace("LAST_STEP", str(last)).replace("HEAD_OPTIONS", options).replace("TOP_K", str(top_k))
            .replace("SCRUBBER_DATA", payload))
    return HTML(html)


def _scrubber_data(recording: DecodeRecording, tokenizer, heads, top_k: int) -> dict:
    decode = recording.steps[recording.steps["phase"] == "decode"]
    if decode.empty:
        raise ValueError("the recording has no decode step: generate at least 2 tokens")
    heads = [(layer, 0) for layer in range(recording.num_layers)] if heads is None else list(heads)
    for layer, head in heads:
        if not (0 <= layer < recording.num_layers and 0 <= head < recording.num_heads):
            raise ValueError(f"no (layer, head) = ({layer}, {head}) in a model of {recording.num_layers} layers "
                             f"and {recording.num_heads} heads; pick layer < {recording.num_layers}, "
                             f"head < {recording.num_heads}")
    steps = decode["step"].tolist()
    missing = [(step, layer) for step in steps for layer in range(recording.num_layers)
               if (step, layer) not in recording.attention] + [step for step in steps if step not in recording.logits]
    if missing:
        raise ValueError(f"the recording lacks attention or logits of decode step(s) {missing[:3]}...; record the "
                         "run with Tracer(model, record_attention=True, record_logits=True)")
    token_of = dict(zip(recording.steps["step"], recording.steps["token_id"], strict=True))
    # a decode step attends over every cached position, itself included: the row's length is the layer's cache
    cache_lens = [[int(recording.attention[(step, layer)].shape[-1]) for layer in range(recording.num_layers)]
                  for step in steps]
    top = []
    for step in steps:
        probs, ids = torch.softmax(recording.logits[step], dim=-1).topk(top_k)
        top.append([[token_id, token_label(tokenizer, token_id), float(f"{p:.3g}")]
                    for token_id, p in zip(ids.tolist(), probs.tolist(), strict=True)])
    views = []
    for layer, head in heads:
        rows = [recording.attention_row(step, layer, head) for step in steps]
        maxima = [float(row.max()) for row in rows]
        quantized = torch.cat([(row / row.max() * 255).round().to(torch.uint8) for row in rows])
        views.append({
            "layer": layer, "head": head,
            "rowMax": [float(f"{m:.6g}") for m in maxima],
            "weights": base64.b64encode(quantized.numpy().tobytes()).decode("ascii"),
            "promptShare": [round(float(row[:recording.prompt_len].sum()), 3) for row in rows],
            "argmax": [int(row.argmax()) for row in rows],
        })
    return {"promptLen": recording.prompt_len, "numLayers": recording.num_layers, "steps": steps,
            "cacheLens": cache_lens, "fed": [int(token_of[step - 1]) for step in steps],
            "chosen": [int(token_of[step]) for step in steps], "ms": [round(float(ms), 1) for ms in decode["ms"]],
            "top": top, "views": views}


def _script_json(data) -> str:
    """JSON that is safe inside a <script> element of an HTML page: no '<', '>' or '&' (so no '</script>' or
    '<!--' from a token's text), and ASCII only."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_SCRUBBER_TEMPLATE = """\
<div class="kvbook-scrubber" id="VIEW_ID">
<style>
#VIEW_ID { font-size: 0.9rem; line-height: 1.4; max-width: 46rem; }
#VIEW_ID .kvs-controls { display: flex; flex-wrap: wrap; align-items: center; gap: 0.4rem 0.8rem; }
#VIEW_ID .kvs-step { flex: 1 1 14rem; }
#VIEW_ID .kvs-cache { display: grid; grid-template-columns: max-content 1fr max-content; gap: 0.15rem 0.6rem;
  align-items: center; margin: 0.5rem 0; }
#VIEW_ID .kvs-track { position: relative; height: 0.8rem; border: 1px solid rgba(128,128,128,0.6); }
#VIEW_ID .kvs-fill-prompt { position: absolute; left: 0; top: 0; bottom: 0; background: rgba(31,119,180,0.55); }
#VIEW_ID .kvs-fill-generated { position: absolute; top: 0; bottom: 0; background: rgba(255,127,14,0.85); }
#VIEW_ID svg { display: block; width: 100%; height: auto; overflow: visible; }
#VIEW_ID table { border-collapse: collapse; margin: 0.3rem 0; }
#VIEW_ID th, #VIEW_ID td { padding: 0.1rem 0.6rem; text-align: left; }
#VIEW_ID td.kvs-num { text-align: right; font-variant-numeric: tabular-nums; }
#VIEW_ID .kvs-token { font-family: monospace; white-space: pre; min-width: 14em; }
#VIEW_ID p { margin: 0.4rem 0; }
#VIEW_ID tr.kvs-chosen { font-weight: bold; }
</style>
<div class="kvs-controls">
<button type="button" class="kvs-prev" aria-label="previous step">&#9664;</button>
<input type="range" class="kvs-step" min="FIRST_STEP" max="LAST_STEP" step="1" value="FIRST_STEP"
  aria-label="decode step">
<button type="button" class="kvs-next" aria-label="next step">&#9654;</button>
<span>decode step <output class="kvs-step-value">FIRST_STEP</output> of LAST_STEP</span>
<label>attention of <select class="kvs-head">HEAD_OPTIONS</select></label>
</div>
<p class="kvs-headline"></p>
<p>Each layer's KV cache (blue: the prompt's positions, orange: the generated tokens' positions):</p>
<div class="kvs-cache"></div>
<svg class="kvs-attention" viewBox="0 0 720 236" role="img" aria-label="attention weights over cached positions">
</svg>
<p class="kvs-attention-text"></p>
<p class="kvs-top-caption"></p>
<table class="kvs-top">
<thead><tr><th>rank</th><th>token id</th><th class="kvs-token">token</th><th>probability</th></tr></thead>
<tbody></tbody>
</table>
<noscript>This scrubber draws the recorded run with JavaScript; enable it to step through the decode steps.
</noscript>
<script type="application/json" class="kvs-data">SCRUBBER_DATA</script>
<script>
(function () {
  "use strict";
  var root = document.getElementById("VIEW_ID");
  var data = JSON.parse(root.querySelector(".kvs-data").textContent);
  var SVG = "http://www.w3.org/2000/svg";
  var W = 720, H = 236, left = 64, right = 14, top = 24, bottom = 48;
  var plotW = W - left - right, plotH = H - top - bottom, base = top + plotH;
  var maxLen = Math.max.apply(null, data.cacheLens[data.cacheLens.length - 1]);
  var slider = root.querySelector(".kvs-step"), select = root.querySelector(".kvs-head");
  var svg = root.querySelector(".kvs-attention");

  // each view's bytes hold every step's row back to back; a row is as long as that layer's cache at the step
  data.views.forEach(function (view) {
    var bin = atob(view.weights), bytes = new Uint8Array(bin.length), offset = 0;
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    view.rows = data.cacheLens.map(function (lens) {
      var row = bytes.subarray(offset, offset + lens[view.layer]);
      offset += lens[view.layer];
      return row;
    });
    view.yMax = 1.05 * Math.max.apply(null, view.rowMax);
  });

  // the layers' cache bars: "layer i", a track filled with prompt and generated positions, the length as text
  var cache = root.querySelector(".kvs-cache"), lengthText = [], fills = [];
  for (var layer = 0; layer < data.numLayers; layer++) {
    var name = document.createElement("span"), track = document.createElement("div");
    var prompt = document.createElement("div"), generated = document.createElement("div");
    var length = document.createElement("span"), count = document.createElement("span");
    name.textContent = "layer " + layer;
    track.className = "kvs-track";
    prompt.className = "kvs-fill-prompt";
    generated.className = "kvs-fill-generated";
    track.append(prompt, generated);
    length.className = "kv-cache-len";
    length.dataset.layer = layer;
    count.append(length, " positions");
    cache.append(name, track, count);
    lengthText.push(length);
    fills.push([prompt, generated]);
  }

  function x(position) { return left + position * plotW / maxLen; }
  function element(tag, attributes, text) {
    var node = document.createElementNS(SVG, tag);
    for (var key in attributes) node.setAttribute(key, attributes[key]);
    if (text !== undefined) node.textContent = text;
    svg.appendChild(node);
    return node;
  }
  function bars(row, from, to, scale) {
    var d = "";
    for (var i = from; i < to; i++) {
      if (row[i] === 0) continue;
      var y = base - row[i] / 255 * scale * plotH;
      d += "M" + x(i).toFixed(2) + " " + base + "V" + y.toFixed(2) + "H" + x(i + 1).toFixed(2) + "V" + base + "Z";
    }
    return d;
  }

  function drawAttention(view, index, cacheLen) {
    var row = view.rows[index], scale = view.rowMax[index] / view.yMax, newest = cacheLen - 1;
    svg.replaceChildren();
    element("rect", {x: x(0), y: top, width: x(data.promptLen) - x(0), height: plotH,
                     fill: "rgba(31,119,180,0.08)"});
    element("rect", {x: x(data.promptLen), y: top, width: x(cacheLen) - x(data.promptLen), height: plotH,
                     fill: "rgba(255,127,14,0.12)"});
    element("text", {x: (x(0) + x(data.promptLen)) / 2, y: top - 8, "text-anchor": "middle",
                     "font-size": 12, fill: "currentColor"}, "prompt: positions 0 to " + (data.promptLen - 1));
    element("text", {x: x(data.promptLen) + 4, y: top - 8, "font-size": 12, fill: "currentColor"},
            "generated: " + (cacheLen - data.promptLen));
    element("path", {d: bars(row, 0, newest, scale), fill: "rgb(31,119,180)", class: "kvs-bars",
                     "data-positions": row.length});
    element("path", {d: bars(row, newest, cacheLen, scale), fill: "rgb(214,39,40)"});
    element("line", {x1: x(data.promptLen), x2: x(data.promptLen), y1: top, y2: base, stroke: "currentColor",
                     "stroke-dasharray": "4 3", "stroke-width": 1});
    element("line", {x1: left, x2: left + plotW, y1: base, y2: base, stroke: "currentColor"});
    element("line", {x1: left, x2: left, y1: top, y2: base, stroke: "currentColor"});
    var ticks = [];
    for (var p = 0; p <= maxLen - 24; p += 64) ticks.push(p);
    ticks.push(maxLen - 1);
    ticks.forEach(function (p) {
      var at = (x(p) + x(p + 1)) / 2;
      element("line", {x1: at, x2: at, y1: base, y2: base + 4, stroke: "currentColor"});
      element("text", {x: at, y: base + 16, "text-anchor": "middle", "font-size": 11, fill: "currentColor"}, p);
    });
    [0, 0.5, 1].forEach(function (f) {
      var y = base - f * plotH;
      element("line", {x1: left - 4, x2: left, y1: y, y2: y, stroke: "currentColor"});
      element("text", {x: left - 7, y: y + 4, "text-anchor": "end", "font-size": 11, fill: "currentColor"},
              f === 0 ? "0" : (f * view.yMax).toPrecision(2));
    });
    element("text", {x: left + plotW / 2, y: H - 8, "text-anchor": "middle", "font-size": 12,
                     fill: "currentColor"}, "cached position (key); red: the new token's own position, " + newest);
    element("text", {x: 0, y: 0, transform: "translate(14," + (top + plotH / 2) + ") rotate(-90)",
                     "text-anchor": "middle", "font-size": 12, fill: "currentColor"}, "attention weight");
  }

  function draw() {
    var index = data.steps.indexOf(Number(slider.value));
    if (index < 0) return;
    var step = data.steps[index], lens = data.cacheLens[index], view = data.views[Number(select.value) || 0];
    var cacheLen = lens[view.layer];
    root.querySelector(".kvs-step-value").textContent = step;
    root.querySelector(".kvs-headline").textContent = "Decode step " + step + " feeds token " + step +
      " (id " + data.fed[index] + ") at position " + (lens[0] - 1) + ", appends its K and V to every layer's " +
      "cache and picks token " + (step + 1) + " (id " + data.chosen[index] + "); this step took " +
      data.ms[index] + " ms.";
    lens.forEach(function (len, layer) {
      lengthText[layer].textContent = len;
      fills[layer][0].style.width = (100 * Math.min(len, data.promptLen) / maxLen) + "%";
      fills[layer][1].style.left = (100 * data.promptLen / maxLen) + "%";
      fills[layer][1].style.width = (100 * Math.max(0, len - data.promptLen) / maxLen) + "%";
    });
    drawAttention(view, index, cacheLen);
    var share = view.promptShare[index];
    root.querySelector(".kvs-attention-text").textContent = "Layer " + view.layer + ", head " + view.head +
      ": the newest position attends over all " + cacheLen + " cached positions (the weights sum to 1). The " +
      data.promptLen + " prompt positions get " + share.toFixed(3) + " of the attention, the " +
      (cacheLen - data.promptLen) + " generated ones " + (1 - share).toFixed(3) + "; the largest weight, " +
      view.rowMax[index].toPrecision(3) + ", is on position " + view.argmax[index] + ".";
    root.querySelector(".kvs-top-caption").textContent = "The TOP_K most likely tokens after step " + step +
      " (candidates for token " + (step + 1) + ")";
    var body = root.querySelector(".kvs-top tbody");
    body.replaceChildren();
    data.top[index].forEach(function (entry, rank) {
      var tr = document.createElement("tr");
      if (entry[0] === data.chosen[index]) tr.className = "kvs-chosen";
      [rank + 1, entry[0], entry[1], entry[2].toPrecision(3) + (entry[0] === data.chosen[index] ? " (chosen)" : "")]
        .forEach(function (value, column) {
          var td = document.createElement("td");
          td.textContent = value;
          td.className = column === 2 ? "kvs-token" : "kvs-num";
          tr.appendChild(td);
        });
      body.appendChild(tr);
    });
  }

  function move(delta) {
    slider.value = Math.min(Number(slider.max), Math.max(Number(slider.min), Number(slider.value) + delta));
    draw();
  }
  slider.addEventListener("input", draw);
  select.addEventListener("change", draw);
  root.querySelector(".kvs-prev").addEventListener("click", function () { move(-1); });
  root.querySelector(".kvs-next").addEventListener("click", function () { move(1); });
  draw();
})();
</script>
</div>
"""
