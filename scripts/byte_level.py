"""GPT-2's byte -> printable character table: the alphabet of byte-level BPE vocabularies (the ByteLevel
pre-tokenizer and decoder of Hugging Face tokenizers), shared by the scripts that build or read such vocabularies;
the tokenizer.json of the 256-token byte vocabulary, and what llama.cpp's converter needs to accept it."""
import sys


def bytes_to_unicode():
    """{byte: the character that stands for it in the vocabulary's token strings}."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer_json():
    """The tokenizer.json of the 256-token byte vocabulary: id b = byte b, no merges."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    return {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "added_tokens": [],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def llama_converter_for_byte_vocab(llama):
    """llama.cpp's convert_hf_to_gguf module (from the source tree `llama`, with its gguf-py), patched to accept the
    byte vocabulary: it is not one of the converter's known pre-tokenizers (they are recognised by a hash of their
    output), so a vocabulary of <= 256 tokens is named "qwen2"; and llama.cpp refuses a BPE vocabulary without merges,
    so one without any gets one merge that no text can reach (its result is not a token)."""
    sys.path.insert(0, str(llama / "gguf-py"))
    sys.path.insert(0, str(llama))
    import convert_hf_to_gguf as conv
    from conversion import base
    import gguf

    original = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer):
        return "qwen2" if len(tokenizer.get_vocab()) <= 256 else original(self, tokenizer)

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    add_to_gguf = gguf.SpecialVocab.add_to_gguf

    def add_with_merges(self, gw, quiet=False):
        if self.load_merges and not self.merges:
            self.merges = ["\u0100 \u0101"]
        return add_to_gguf(self, gw, quiet=quiet)

    gguf.SpecialVocab.add_to_gguf = add_with_merges
    return conv
