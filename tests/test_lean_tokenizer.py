"""models/lean_tokenizer.py: a BPE tokenizer's Python build copies dropped, its encodings unchanged."""

from transformers import AutoTokenizer
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from kvmemory.models import lean_tokenizer

TEXTS = ["Hello world, the answer is 42.", "a b  c\nlow lower lowest", "ünïcödé 🙂 ..."]


def _qwen2_folder(tmp_path):
    """A small byte-level Qwen2 tokenizer (transformers' own class), saved as a model folder's would be."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    merges = [("l", "o"), ("lo", "w"), ("e", "r"), ("Ġ", "low")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_the_build_copies_are_dropped_and_encodings_unchanged(tmp_path):
    folder = str(_qwen2_folder(tmp_path))
    stock = AutoTokenizer.from_pretrained(folder)
    assert isinstance(stock.__dict__.get("_vocab"), dict) and isinstance(stock.__dict__.get("_merges"), list)
    lean = lean_tokenizer.load(folder)
    assert type(lean) is type(stock)
    assert lean.__dict__["_vocab"] is None and lean.__dict__["_merges"] is None
    for text in TEXTS:
        ids = stock(text)["input_ids"]
        assert lean(text)["input_ids"] == ids
        assert lean.decode(ids) == stock.decode(ids)
    assert lean.get_vocab() == stock.get_vocab()


def test_a_tokenizer_without_build_copies_is_left_alone():
    class Plain:
        _tokenizer = object()

    t = Plain()
    assert lean_tokenizer.drop_build_copies(t) is t and not hasattr(t, "_vocab")
