"""The rendered book's decode-step scrubber (kvbook.tools.book.static_scrubber): the data it puts into the page, read
back from the HTML, against the recorded run it comes from. tests/browser checks that the page draws them."""

import base64
import json
import re

import pytest
import torch
from kvbook.runtime.engine import Engine
from kvbook.tokenizer import get_default_tokenizer
from kvbook.tools.book import DecodeRecording, static_scrubber, token_label
from kvbook.tools.trace import Tracer

from .conftest import small_config

PROMPT_LEN, NEW_TOKENS = 16, 8  # decode steps 1..7, caches of 17..23 positions
DATA = re.compile(r'<script type="application/json" class="kvs-data">(.*?)</script>', re.S)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A greedy run of a tiny 3-layer model, traced with attention and logits: (recording, output ids)."""
    cache_home = tmp_path_factory.mktemp("xdg")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache_home))
        config = small_config(layers=3)
        engine = Engine(config, progress=False)
        with torch.no_grad(), Tracer(engine.model, record_attention=True, record_logits=True) as tracer:
            run = engine.generate(list(range(100, 100 + PROMPT_LEN)), NEW_TOKENS, ignore_eos=True, tracer=tracer)
    return DecodeRecording.from_tracer(tracer, config.model), run.output_ids


def payload(html: str) -> dict:
    found = DATA.findall(html)
    assert len(found) == 1, "the scrubber carries exactly one data block"
    return json.loads(found[0])


def test_one_frame_per_decode_step_numbered_from_1_with_each_layers_cache_length(recorded):
    recording, output_ids = recorded
    html = static_scrubber(recording, get_default_tokenizer()).data
    data = payload(html)
    last = NEW_TOKENS - 1
    assert data["steps"] == list(range(1, last + 1))  # prefill (step 0) is not a frame
    assert data["cacheLens"] == [[PROMPT_LEN + step] * 3 for step in range(1, last + 1)]
    assert data["promptLen"] == PROMPT_LEN and data["numLayers"] == 3
    # step s feeds token s (the previous step's choice) and picks token s + 1
    assert data["fed"] == output_ids[:-1] and data["chosen"] == output_ids[1:]
    assert len(data["ms"]) == last
    assert f'min="1" max="{last}" step="1" value="1"' in html


def test_top_tokens_are_the_recorded_logits_top_5(recorded):
    recording, output_ids = recorded
    tokenizer = get_default_tokenizer()
    data = payload(static_scrubber(recording, tokenizer).data)
    for index, step in enumerate(data["steps"]):
        probs, ids = torch.softmax(recording.logits[step], dim=-1).topk(5)
        assert [entry[0] for entry in data["top"][index]] == ids.tolist()
        assert [entry[1] for entry in data["top"][index]] == [repr(tokenizer.token_text(i)) for i in ids.tolist()]
        # 3 significant digits: within half a unit of the third digit
        torch.testing.assert_close(torch.tensor([entry[2] for entry in data["top"][index]]), probs,
                                   rtol=5e-3, atol=0)
        assert data["top"][index][0][0] == output_ids[step]  # greedy: the chosen token is the most likely one


def test_attention_rows_cover_every_cached_position_and_decode_to_the_recorded_weights(recorded):
    recording, _ = recorded
    data = payload(static_scrubber(recording, get_default_tokenizer(), heads=[(0, 0), (2, 3)]).data)
    assert [(view["layer"], view["head"]) for view in data["views"]] == [(0, 0), (2, 3)]
    for view in data["views"]:
        weights = torch.frombuffer(bytearray(base64.b64decode(view["weights"])), dtype=torch.uint8)
        lengths = [lens[view["layer"]] for lens in data["cacheLens"]]
        assert weights.numel() == sum(lengths)
        for row, step, row_max, share, argmax in zip(weights.split(lengths), data["steps"], view["rowMax"],
                                                     view["promptShare"], view["argmax"], strict=True):
            recorded_row = recording.attention_row(step, view["layer"], view["head"])
            assert int(row.max()) == 255 and row_max == pytest.approx(float(recorded_row.max()), rel=1e-5)
            # one byte per weight, scaled to the row's maximum (6 digits): within half a level of the recorded weight
            tolerance = row_max * (1 / 510 + 1e-5)
            torch.testing.assert_close(row.float() / 255 * row_max, recorded_row, atol=tolerance, rtol=0)
            assert share == pytest.approx(float(recorded_row[:PROMPT_LEN].sum()), abs=5e-4)
            assert argmax == int(recorded_row.argmax())


def test_token_label_shows_whitespace_and_names_padding_ids():
    tokenizer = get_default_tokenizer()
    assert token_label(tokenizer, tokenizer.encode("\n")[0]) == "'\\n'"
    # the full-size model's 151,936 logits include padding rows past the vocabulary: no text, and no KeyError
    assert token_label(tokenizer, 151935) == "(padding id: no text)"


class HostileTokenizer:
    """Token texts that would end the script element or open an HTML comment if written into the page raw."""

    def token_text(self, token_id):
        return f"</script><script>alert({token_id})</script><!--&amp;"


def test_token_text_cannot_break_out_of_the_script_element(recorded):
    recording, _ = recorded
    html = static_scrubber(recording, HostileTokenizer()).data
    assert html.count("</script>") == 2  # the data block's end and the drawing code's end, nothing from tokens
    assert "<!--" not in html and "alert(" not in html.split('class="kvs-data">')[1].split("</script>")[1]
    text = payload(html)["top"][0][0][1]
    assert text == repr(HostileTokenizer().token_text(payload(html)["top"][0][0][0]))


def test_same_recording_same_page(recorded):
    recording, _ = recorded
    tokenizer = get_default_tokenizer()
    first, second = static_scrubber(recording, tokenizer).data, static_scrubber(recording, tokenizer).data
    assert first == second
    other_heads = static_scrubber(recording, tokenizer, heads=[(1, 1)]).data
    ids = [re.search(r'id="(kvbook-scrubber-[0-9a-f]+)"', html).group(1) for html in (first, other_heads)]
    assert ids[0] != ids[1]  # two scrubbers on one page do not share an element id


def test_bad_input_says_what_to_do(recorded):
    recording, _ = recorded
    with pytest.raises(ValueError, match=r"no \(layer, head\) = \(3, 0\).*pick layer < 3"):
        static_scrubber(recording, get_default_tokenizer(), heads=[(3, 0)])
    without_attention = DecodeRecording(recording.steps, {}, recording.logits, recording.prompt_len,
                                        recording.num_layers, recording.num_heads)
    with pytest.raises(ValueError, match="record_attention=True"):
        static_scrubber(without_attention, get_default_tokenizer())
    prefill_only = DecodeRecording(recording.steps.iloc[:1], recording.attention, recording.logits,
                                   recording.prompt_len, recording.num_layers, recording.num_heads)
    with pytest.raises(ValueError, match="no decode step"):
        static_scrubber(prefill_only, get_default_tokenizer())
