"""Streamed text never shows half a character: a character whose UTF-8 bytes span two tokens is held
back until the token that completes it (kvmemory.memory.token_text), so the deltas a client joins are
the final answer, on the embedded SmolLM2's real byte-level tokenizer."""

from __future__ import annotations

import pytest

from kvmemory.memory.token_text import TokenText

REPLACEMENT = "\ufffd"
# Japanese, Chinese and emoji: SmolLM2's tokenizer splits many of these characters' bytes across tokens.
TEXTS = ["日本語の答えです🙂", "答案是四十二", "émoji 🎉 ok", "plain ascii"]


@pytest.fixture(scope="module")
def tokenizer(smollm):
    return smollm.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_decoded_text_without_half_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    tt = TokenText(tokenizer.decode)
    deltas = [tt.add(t) for t in ids]
    rest = tt.rest()
    assert "".join(deltas) + rest == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT in d for d in deltas)
    assert rest == ""  # every character was complete by the last token


def test_the_texts_do_split_characters_across_tokens(tokenizer):
    # What makes the test above meaningful: decoding a prefix of these ids does end in U+FFFD.
    split = {t for t in TEXTS[:3]
             if any(tokenizer.decode(ids[:i]).endswith(REPLACEMENT)
                    for ids in [tokenizer.encode(t, add_special_tokens=False)] for i in range(1, len(ids)))}
    assert split == set(TEXTS[:3])


def test_a_replacement_character_the_model_really_wrote_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode("ok " + REPLACEMENT, add_special_tokens=False)
    tt = TokenText(tokenizer.decode)
    shown = "".join(tt.add(t) for t in ids)
    assert REPLACEMENT not in shown
    assert shown + tt.rest() == "ok " + REPLACEMENT


def test_skipped_tokens_stay_out_of_the_text(tokenizer):
    ids = tokenizer.encode("hello", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    tt = TokenText(tokenizer.decode, skip={eos})
    shown = "".join(tt.add(t) for t in [*ids, eos]) + tt.rest()
    assert shown == tt.text == "hello"
    assert tt.tokens == [*ids, eos]


def test_a_streamed_japanese_answer_adds_up_to_the_answer(real_memory):
    # The embedded model answering in Japanese splits characters across tokens (asserted), and the
    # text a streaming client joins from `on_text` is the answer's text.
    mem = real_memory
    ids = mem.question_ids("How do you say thank you in Japanese? Answer in Japanese only.")
    deltas: list[str] = []
    ans = mem.generate(ids, max_new_tokens=24, on_text=deltas.append)
    tok = mem.engine.tokenizer
    assert any(tok.decode(ans.token_ids[:i]).endswith(REPLACEMENT) for i in range(1, len(ans.token_ids)))
    assert "".join(deltas).strip() == ans.text
    assert not any(REPLACEMENT in d for d in deltas[:-1])
