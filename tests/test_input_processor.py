"""The input processor that LLM and the server share: tokenising, the chat template and the
checks, against the tokenizer itself (HF transformers)."""

from __future__ import annotations

import time

import pytest

from jaxllm.engine.input_processor import InputError, InputProcessor


@pytest.fixture(scope="module")
def processor(tiny_tokenizer):
    return InputProcessor(tiny_tokenizer, max_model_len=64, vocab_size=1000)


def test_prompt_forms_match_the_tokenizer(processor, tiny_tokenizer):
    text = "hello world, the lazy dog"
    ids = tiny_tokenizer.encode(text)
    assert processor.process(text).token_ids == ids
    assert processor.process({"prompt": text}).token_ids == ids
    assert processor.process(ids).text is None
    assert processor.process({"prompt": "x", "prompt_token_ids": ids}).text == "x"
    from_ids = processor.from_token_ids(ids)
    assert (from_ids.token_ids, from_ids.text) == (ids, tiny_tokenizer.decode(ids))


def test_chat_matches_the_template(processor, tiny_tokenizer):
    conversation = [{"role": "user", "content": "hello"}]
    text = tiny_tokenizer.apply_chat_template(conversation, tokenize=False,
                                              add_generation_prompt=True)
    rendered = processor.from_chat(conversation)
    assert rendered.text == text
    assert rendered.token_ids == tiny_tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(InputError, match="cannot both be true"):
        processor.from_chat(conversation, continue_final_message=True)


def test_checks_name_the_limit(processor, tiny_tokenizer):
    assert processor.vocab_size == len(tiny_tokenizer)  # the smaller of model and tokenizer
    with pytest.raises(InputError, match=f"Token id 999 is out of vocabulary .*{len(tiny_tokenizer)}"):
        processor.process([5, 999])
    with pytest.raises(InputError, match="cannot be empty"):
        processor.process([])
    with pytest.raises(InputError, match="length 65.* maximum model length of 64"):
        processor.process([5] * 65)
    with pytest.raises(InputError, match="maximum context length is 64 tokens.*60 in the "
                                         "messages, 10 in the completion") as info:
        processor.check_context(60, 10)
    assert info.value.param == "max_tokens"
    processor.check_context(54, 10)
    with pytest.raises(InputError, match="your request has 64 input tokens"):
        processor.check_context(64, None)


def test_huge_text_is_refused_before_tokenising(processor):
    huge = "hello world " * 2_000_000  # 24 MB: a CPU minute to tokenise
    start = time.perf_counter()
    for call in (lambda: processor.from_text(huge),
                 lambda: processor.from_chat([{"role": "user", "content": huge}])):
        with pytest.raises(InputError, match="maximum context length is 64 tokens"):
            call()
    assert time.perf_counter() - start < 2.0
    # The bound never refuses what could fit: the longest entry, max_model_len times.
    longest = max(processor.tokenizer.get_vocab(), key=len)
    assert processor.max_prompt_chars >= 64 * len(longest)


def test_without_a_tokenizer_only_ids():
    processor = InputProcessor(None, max_model_len=16, vocab_size=100)
    assert processor.process([1, 99]).token_ids == [1, 99]
    with pytest.raises(InputError, match="without a tokenizer"):
        processor.process("hello")
    with pytest.raises(InputError, match="Token id 100"):
        processor.process([100])
