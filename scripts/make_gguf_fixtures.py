#!/usr/bin/env python3
"""Builds the GGUF fixtures of tests/gguf_import_test.cpp with llama.cpp's own converter, from the transformers parity
fixtures (tests/fixtures/parity, written by scripts/make_parity_fixtures.py), so that the import is checked against
what convert_hf_to_gguf.py really writes (its A_log, norm, q/k/v/z and V-head transforms), not against a second copy
of them.

    scripts/make_gguf_fixtures.py --llama-dir DIR [--out tests/fixtures/gguf] [--outtype f32]
    scripts/make_gguf_fixtures.py --llama-dir DIR --hf HF_DIR --outfile FILE.gguf [--outtype f32]
        (any Hugging Face checkpoint of a byte-level model; bench/gguf_logits.sh)

DIR is a llama.cpp source tree (convert_hf_to_gguf.py, conversion/, gguf-py/). Each fixture gets a byte-level
tokenizer.json of 256 tokens (the parity models' vocabulary; id b = byte b) and a chat template, so the converter
has a tokenizer to write; it is read as a plain PreTrainedTokenizerFast (transformers' Qwen3.5 tokenizer class would
add an <|endoftext|> beyond the 256). The byte vocabulary is not one of the converter's known pre-tokenizers (it recognises them
by a hash of their output), so it is named "qwen2"; llama.cpp refuses a BPE vocabulary without merges, so it gets
one merge that no text can reach (its result is not a token). --no-mtp: the fixtures have no MTP head.
"""
import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ["qwen3_next_L5", "qwen3_5_L5"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer_json():
    sys.path.insert(0, str(ROOT / "scripts"))
    from byte_level import bytes_to_unicode

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


def patch_converter(llama):
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
    import transformers

    auto = transformers.AutoTokenizer.from_pretrained

    def plain_fast(path, *args, **kwargs):
        if (Path(path) / "tokenizer.json").is_file() and len(json.loads((Path(path) / "tokenizer.json").read_text())
                                                             ["model"]["vocab"]) <= 256:
            return transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(path) / "tokenizer.json"))
        return auto(path, *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = plain_fast
    return conv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-dir", required=True)
    ap.add_argument("--out", default=str(ROOT / "tests/fixtures/gguf"))
    ap.add_argument("--outtype", default="f32")
    ap.add_argument("--fixtures", nargs="*", default=FIXTURES)
    ap.add_argument("--hf")
    ap.add_argument("--outfile")
    a = ap.parse_args()
    conv = patch_converter(Path(a.llama_dir).resolve())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sources = [(Path(a.hf), Path(a.outfile))] if a.hf else \
        [(ROOT / "tests/fixtures/parity" / n, out / f"{n}.{a.outtype}.gguf") for n in a.fixtures]
    for src, target in sources:
        with tempfile.TemporaryDirectory() as tmp:
            hf = Path(tmp) / src.name
            hf.mkdir()
            for f in src.iterdir():
                if f.name.endswith(".json") or f.name.endswith(".safetensors") and f.name != "debug.safetensors":
                    shutil.copy(f, hf / f.name)
            if not (hf / "tokenizer.json").exists():
                (hf / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False))
                (hf / "tokenizer_config.json").write_text(json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}))
            sys.argv = ["convert_hf_to_gguf.py", str(hf), "--outtype", a.outtype, "--no-mtp", "--outfile", str(target)]
            conv.main()
            print(f"wrote {target}")


if __name__ == "__main__":
    main()
