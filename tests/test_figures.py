"""kvbook.tools.figures: the pictures render for a small and for the full-size config, and their labels follow the
configuration they are drawn from (change a size, the label changes)."""

import dataclasses
import math

import matplotlib
import matplotlib.pyplot as plt
import pytest
from kvbook import ModelConfig
from kvbook.tools.figures import (
    block_table_diagram,
    figure_texts,
    kv_append_diagram,
    layer_diagram,
    rope_diagram,
    rope_periods,
    tensor_parallel_diagram,
    timeline_diagram,
)

matplotlib.use("Agg")

FULL = ModelConfig()
SMALL = ModelConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=96,
                    vocab_size=300, num_key_value_heads=2)


def rendered_texts(fig):
    fig.canvas.draw()  # a real render: any drawing error shows up here
    texts = " | ".join(figure_texts(fig))
    plt.close(fig)
    return texts


@pytest.mark.parametrize("cfg", [FULL, SMALL], ids=["full", "small"])
def test_layer_diagram_labels_carry_the_config(cfg):
    texts = rendered_texts(layer_diagram(cfg, tokens=7))
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    assert f"[1, 7, {hidden}]" in texts
    assert f"[1, 7, {inter}]" in texts
    assert f"Q [1, 7, {cfg.num_attention_heads}, {cfg.head_dim}]" in texts
    assert f"K, V [1, {cfg.num_key_value_heads}, 7, {cfg.head_dim}]" in texts
    assert f"down_proj ({inter} \u2192 {hidden})" in texts
    assert "RoPE (V as is)" in texts  # V takes neither the norms nor RoPE


def test_layer_diagram_follows_a_changed_hidden_size():
    wider = dataclasses.replace(FULL, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8)
    before, after = rendered_texts(layer_diagram(FULL, 256)), rendered_texts(layer_diagram(wider, 256))
    assert "[1, 256, 4096]" in before and "[1, 256, 4096]" not in after
    assert "[1, 256, 5120]" in after and "40 heads of 128" in after


def test_timeline_marks_ttft_and_tpot_and_counts_steps():
    schematic = rendered_texts(timeline_diagram(256, 5))
    assert "TTFT" in schematic and "TPOT" in schematic
    assert "256 positions" in schematic and "5 decode steps" in schematic
    assert "schematic" in schematic
    # token 1 comes out of prefill, each decode box is marked with the token its step gives: 2 .. steps + 1
    boxes = schematic.split(" | ")
    assert "\u2192 token 1" in schematic and {"2", "6"} <= set(boxes) and "1" not in boxes
    measured = timeline_diagram(64, 3, ttft_ms=900.0, tpot_ms=60.0)
    assert measured.axes[0].get_xlim()[1] == pytest.approx((900 + 3 * 60) * 1.02)
    assert "time (ms)" in rendered_texts(measured)


def overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of texts whose drawn boxes overlap (a real render measures them)."""
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text() and t.get_visible()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    return [(a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1:] if box_a.overlaps(box_b)]


def test_timeline_step_numbers_never_run_into_each_other():
    # chapter 1's figure: 15 decode steps of ~250 ms after a ~7 s prefill, the numbers 2 .. 16 in narrow boxes
    fig = timeline_diagram(256, 15, ttft_ms=7400.0, tpot_ms=250.0)
    fig.canvas.draw()
    assert not overlapping_texts(fig)
    numbers = [t for t in figure_texts(fig) if t.isdigit()]
    assert numbers[0] == "2" and len(numbers) >= 4  # every k-th box keeps its number, starting at the first
    plt.close(fig)
    wide = timeline_diagram(256, 5)  # schematic boxes are wide: every one is numbered
    assert [t for t in figure_texts(wide) if t.isdigit()] == ["2", "3", "4", "5", "6"]
    plt.close(wide)


def test_block_table_labels_never_run_into_each_other():
    # chapter 9's figure: 19 blocks of a sequence and 5 of another in a pool of 24 columns
    fig = block_table_diagram(list(range(40, 56)) + [59, 60, 63], cache_len=296, block_size=16,
                              other_blocks=[56, 57, 58, 61, 62])
    fig.canvas.draw()
    assert not overlapping_texts(fig)
    plt.close(fig)


@pytest.mark.parametrize("cfg", [FULL, SMALL], ids=["full", "small"])
def test_kv_append_draws_every_layer_and_the_final_shape(cfg):
    fig = kv_append_diagram(cfg, prompt_len=10, decode_steps=3)
    rows = 2 * cfg.num_hidden_layers
    rectangles = [p for p in fig.axes[0].patches if isinstance(p, matplotlib.patches.Rectangle)]
    assert len(rectangles) == rows * (1 + 3)  # the prompt block and one column per step, per layer, K and V
    texts = rendered_texts(fig)
    assert f"layer {cfg.num_hidden_layers - 1} V" in texts
    assert f"[1, {cfg.num_key_value_heads}, 13, {cfg.head_dim}]" in texts


def test_block_table_points_each_logical_block_at_its_physical_block():
    table, other = [4, 5, 9], [6, 7]
    fig = block_table_diagram(table, cache_len=40, block_size=16, other_blocks=other)
    arrows = [a for a in fig.axes[0].texts if isinstance(a, matplotlib.text.Annotation)]
    assert len(arrows) == len(table)
    # each arrow ends above the physical block the table names; the pool row shows blocks 4..9 in order
    pool_row = sorted((t.get_position()[0], t.get_text()) for t in fig.axes[0].texts
                      if not isinstance(t, matplotlib.text.Annotation) and t.get_position()[1] == 0.35
                      and t.get_text().isdigit())
    assert [label for _, label in pool_row] == [str(b) for b in range(4, 10)]
    pool_x = {label: x for x, label in pool_row}
    assert [arrow.xy[0] for arrow in arrows] == [pool_x[str(b)] for b in table]
    texts = rendered_texts(fig)
    assert "40 positions in 3 blocks of 16 (last one holds 8)" in texts


def test_the_attention_heatmap_draws_no_grid_over_the_weights():
    import torch
    from kvbook.tools.book import plot_attention_heatmap

    fig = plot_attention_heatmap(torch.rand(8, 8).tril(), "one head")
    fig.canvas.draw()
    heatmap = fig.axes[0]
    assert not any(line.get_visible() for line in heatmap.get_xgridlines() + heatmap.get_ygridlines())
    plt.close(fig)


def test_every_figure_a_chapter_draws_has_alt_text():
    # MyST-NB puts a cell's `mystnb.image.alt` on the <img> of its figure; a screen reader, or a reader whose
    # images do not load, gets that text instead of nothing
    import json
    from pathlib import Path

    missing, figures = [], 0
    for path in sorted((Path(__file__).parent.parent / "chapters").glob("*.ipynb")):
        for index, cell in enumerate(json.loads(path.read_text("utf-8"))["cells"]):
            if any("image/png" in output.get("data", {}) for output in cell.get("outputs", [])):
                figures += 1
                if len(cell["metadata"].get("mystnb", {}).get("image", {}).get("alt", "").strip()) < 20:
                    missing.append(f"{path.name} cell {index}")
    assert figures >= 15 and not missing, f"figures without alt text: {missing}"


def test_the_paged_cache_animation_frame_has_alt_text():
    from kvbook.tools.book import block_table_animation

    html = block_table_animation([[0], [0, 1], [0, 1, 2]], [10, 20, 40], 16, frames=3).data
    assert html.count("<img ") == 1 and '<img alt="The paged KV cache filling' in html
    assert "font-awesome" not in html  # and it still renders offline


@pytest.mark.parametrize("cfg", [FULL, SMALL], ids=["full", "small"])
def test_rope_diagram_labels_its_pairs_periods_from_the_config(cfg):
    periods = rope_periods(cfg)
    assert len(periods) == cfg.head_dim // 2 and periods[0] == pytest.approx(2 * math.pi)  # pair 0: 1 radian a step
    texts = rendered_texts(rope_diagram(cfg, pairs=(0, 4)))
    assert f"{cfg.head_dim // 2} pairs of a {cfg.head_dim}-dim head, theta = {cfg.rope_theta:g}" in texts
    assert f"pair 4: a turn per {periods[4]:,.0f} positions" in texts
    assert "query at position 255" in texts and "query at position 2047" in texts


def test_rope_scores_depend_only_on_the_distance():
    fig = rope_diagram(FULL)
    near, far = (line.get_ydata() for line in fig.axes[1].get_lines())
    plt.close(fig)
    # equal but for the float32 angles (the model's, as transformers'): position x frequency rounds to ~1e-4 rad
    assert len(near) == 256 and max(abs(a - b) for a, b in zip(near, far, strict=True)) < 1e-3 < max(abs(near))


@pytest.mark.parametrize("cfg, world_size", [(FULL, 2), (SMALL, 2), (FULL, 4)], ids=["full-2", "small-2", "full-4"])
def test_tensor_parallel_diagram_gives_each_rank_its_heads_and_columns(cfg, world_size):
    texts = rendered_texts(tensor_parallel_diagram(cfg, world_size))
    heads, width = cfg.num_attention_heads // world_size, cfg.intermediate_size // world_size
    last = world_size - 1
    assert f"q/k/v_proj: query heads {last * heads}-{cfg.num_attention_heads - 1}" in texts
    assert f"K/V cache [1, {cfg.num_key_value_heads // world_size}, T, {cfg.head_dim}]" in texts
    assert f"gate/up_proj: columns {last * width}-{cfg.intermediate_size - 1}" in texts
    assert texts.count(f"all-reduce: each rank gets the sum of the {world_size} partial [T, {cfg.hidden_size}]") == 2
    assert texts.count(f"lm_head: all {cfg.vocab_size:,} rows") == world_size and f"rank {last}" in texts
