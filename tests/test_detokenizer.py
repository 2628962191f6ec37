"""Incremental detokenisation and stop strings with a byte-level BPE tokenizer built in-test."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxllm.detok import IncrementalDetokenizer, find_stop_string
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

CORPUS = ["The quick brown fox jumps over the lazy dog. Hello world, hello again!",
          "你好，世界。今天天气很好。", "Stop here. END of text. Ünïcödé façade naïve café."]
# Emoji and rare CJK are not in the corpus, so they encode as several single-byte tokens.
TEXTS = ["Hello world 😀 and 🎉🎉 done", "你好，世界。龘靐 are rare", "café naïve 👩‍👩‍👧 END here.",
         "The quick 🦊 jumps over the lazy 🐶. STOP now"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def feed(detok, ids, chunk_sizes=(1,), finished_last=True):
    """Feeds ids in chunks; returns (streamed deltas, stop string)."""
    deltas, i, stop, sizes = [], 0, None, list(chunk_sizes)
    while i < len(ids) and stop is None:
        n = sizes[len(deltas) % len(sizes)]
        stop = detok.update(ids[i:i + n])
        i += n
        deltas.append(detok.get_next_output_text(finished=stop is not None or i >= len(ids),
                                                 delta=True))
    return deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [(1,), (2, 3), (5,)])
def test_incremental_equals_full_decode_and_never_emits_broken_characters(tokenizer, text, chunks):
    prompt = tokenizer.encode("hello ").ids
    ids = tokenizer.encode(text).ids
    # The case under test happens: some token boundary splits a multi-byte character.
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(1, len(ids)))
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas, stop = feed(detok, ids, chunks)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids) == text
    assert list(detok.token_ids) == ids


@pytest.mark.parametrize("text", TEXTS)
def test_final_only_decodes_once_at_the_end_to_the_same_text(tokenizer, text):
    """FINAL_ONLY without stop strings: no text until the final output is asked for, then the
    text the per-step detokenizer builds (an EOS-like last token left out); with stop strings
    it still decodes as it goes, to find them."""
    prompt, ids = tokenizer.encode("hello ").ids, tokenizer.encode(text).ids
    final = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    per_step, deferred = (IncrementalDetokenizer(tokenizer, prompt, p)
                          for p in (SamplingParams(), final))
    for detok in (per_step, deferred):
        for i in range(0, len(ids) - 1, 3):
            detok.update(ids[i:min(i + 3, len(ids) - 1)])
        detok.update(ids[-1:], stop_terminated=True)
    assert deferred.output_text == "" and list(deferred.token_ids) == ids
    assert (deferred.get_next_output_text(finished=True, delta=False)
            == per_step.get_next_output_text(finished=True, delta=False)
            == tokenizer.decode(ids[:-1]))
    stops = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(
        stop=[text[-4:]], output_kind=RequestOutputKind.FINAL_ONLY))
    assert stops.update(ids) == text[-4:]


def test_skip_special_tokens(tokenizer):
    im_end = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("Hello world").ids + [im_end] + tokenizer.encode(" again").ids
    for skip, want in ((True, "Hello world again"), (False, "Hello world<|im_end|> again")):
        detok = IncrementalDetokenizer(tokenizer, [im_end], SamplingParams(skip_special_tokens=skip))
        feed(detok, ids)
        assert detok.output_text == want


def test_stop_token_text_is_left_out_unless_included(tokenizer):
    ids = tokenizer.encode("Hello world.").ids
    for include, want in ((False, tokenizer.decode(ids[:-1])), (True, "Hello world.")):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(
            stop_token_ids=[ids[-1]], include_stop_str_in_output=include))
        detok.update(ids[:-1])
        assert detok.update(ids[-1:], stop_terminated=True) is None
        assert detok.output_text == want and list(detok.token_ids) == ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tokenizer, include):
    text = "The quick 🦊 jumps over the lazy 🐶. STOP now"
    ids = tokenizer.encode(text).ids
    for stop in ["🦊 jum", "lazy 🐶", "y 🐶.", "STOP"]:
        # The stop string spans several tokens.
        assert not any(stop in tokenizer.decode([i]) for i in ids)
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(
            stop=["never", stop], include_stop_str_in_output=include))
        deltas, found = feed(detok, ids)
        cut = text.index(stop) + (len(stop) if include else 0)
        assert found == stop and detok.output_text == text[:cut] == "".join(deltas)


def test_streamed_text_never_shows_a_partial_stop_string(tokenizer):
    """Every streamed prefix is a prefix of the final text: nothing shown is cut later."""
    text = "Stop here. END of text. END"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["END of"]))
    shown = ""
    for i, token in enumerate(ids):
        found = detok.update([token])
        shown += detok.get_next_output_text(finished=found is not None, delta=True)
        assert "E" not in shown or found is not None
        if found:
            break
    assert found == "END of" and shown == detok.output_text == "Stop here. "
    # Without the hold-back the "END" would have been streamed before the cut.
    assert detok.stop_buffer_length == len("END of") - 1


def test_min_tokens_delays_stop_strings(tokenizer):
    text = "Hello world, hello again!"
    ids = tokenizer.encode(text).ids
    first_hello_end = next(i for i in range(len(ids)) if "Hello" in tokenizer.decode(ids[:i + 1]))
    for chunks in ((1,), (len(ids),)):  # token by token, and all in one update
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(
            stop=["ello"], min_tokens=first_hello_end + 1))
        _, found = feed(detok, ids, chunks)
        assert found == "ello" and detok.output_text == "Hello world, h"


def test_earliest_of_several_stop_strings_wins():
    assert find_stop_string("xx. \n\nyy", 6, ["\n\n", "."], False) == (".", 2)
    assert find_stop_string("xx. \n\nyy", 6, ["\n\n", "."], True) == (".", 3)
    assert find_stop_string("abcabc", 1, ["abc"], False) == ("abc", 3)  # old text not searched
    assert find_stop_string("abcabc", 1, ["ab"], False) is None


def test_random_texts_with_random_stop_strings(tokenizer):
    rng = random.Random(0)
    alphabet = list("abc xyz.,") + ["😀", "世", "界", "龘", "é", "👩‍👧"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tokenizer.encode(text).ids
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 4)]
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt 😀").ids,
                                       SamplingParams(stop=[stop], include_stop_str_in_output=include))
        deltas, found = feed(detok, ids, (rng.randint(1, 3),))
        cut = text.index(stop) + (len(stop) if include else 0)
        assert found == stop and detok.output_text == text[:cut] == "".join(deltas), (text, stop)
        assert all("\ufffd" not in d for d in deltas)


def test_prompt_priming_keeps_the_first_word_marker_space():
    """SentencePiece-style decoders drop the word marker's space at the start of a text; primed
    with the prompt, the first output word keeps its space (as vLLM)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    output = tok.encode("Hello world again").ids[1:]
    assert tok.decode(output) == "world again"
    for prompt in ("Hello", "The quick brown fox jumps over the lazy dog. Hello"):
        assert len(tok.encode(prompt).ids) < 4 or len(tok.encode(prompt).ids) > 8
        detok = IncrementalDetokenizer(tok, tok.encode(prompt).ids, SamplingParams())
        feed(detok, output)
        assert detok.output_text == " world again"


def test_transformers_fast_tokenizer_is_accepted(tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    ids = tokenizer.encode(TEXTS[0]).ids
    detok = IncrementalDetokenizer(hf, [], SamplingParams())
    feed(detok, ids)
    assert detok.output_text == TEXTS[0]
    with pytest.raises(ValueError, match="fast tokenizer"):
        IncrementalDetokenizer(object(), [], SamplingParams())
