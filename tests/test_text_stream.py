"""Token ids -> text pieces (kvbook.serving.text_stream), with the real Qwen vocabulary: a piece never ends inside a
UTF-8 character, a stop string is held back until it is decided and never sent, and the pieces add up."""

from kvbook.serving.text_stream import TextStream
from kvbook.tokenizer import IM_END_ID, get_default_tokenizer


def pieces_of(text: str, stop: list[str]) -> tuple[list[str], TextStream]:
    tokenizer = get_default_tokenizer()
    stream = TextStream(tokenizer, stop)
    pieces = []
    for token_id in tokenizer.encode(text):
        pieces.append(stream.add(token_id))
        if stream.stopped:
            break
    return pieces + [stream.finish()], stream


def test_pieces_add_up_and_never_split_a_character():
    text = "KV 缓存 keeps K and V 🙂 of every position."
    tokenizer = get_default_tokenizer()
    assert any("\ufffd" in tokenizer.decode([i]) for i in tokenizer.encode(text))  # some token ends mid-character
    pieces, stream = pieces_of(text, [])
    assert "".join(pieces) == text and not stream.stopped
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_stop_string_across_tokens_ends_the_text_before_it_and_is_never_sent():
    # "decode app" spans the tokens " decode" and " app": " decode" must be held back until " app" decides it
    pieces, stream = pieces_of("Prefill fills the cache, and decode appends to it.", ["decode app"])
    assert stream.stopped and "".join(pieces) == "Prefill fills the cache, and "
    assert not any("decode" in piece for piece in pieces)


def test_end_of_sequence_adds_no_text():
    stream = TextStream(get_default_tokenizer(), [])
    assert stream.add(IM_END_ID) == "" and stream.finish() == ""
