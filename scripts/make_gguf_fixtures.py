#!/usr/bin/env python3
"""Builds the GGUF fixtures of tests/gguf_import_test.cpp with llama.cpp's own converter, from the transformers parity
fixtures (tests/fixtures/parity, written by scripts/make_parity_fixtures.py), so that the import is checked against
what convert_hf_to_gguf.py really writes (its A_log, norm, q/k/v/z and V-head transforms), not against a second copy
of them.

    scripts/make_gguf_fixtures.py --llama-dir DIR [--out tests/fixtures/gguf] [--outtype f32]
    scripts/make_gguf_fixtures.py --llama-dir DIR --dense
        also writes tests/fixtures/gguf/qwen3_5_dense_L5 (a random dense Qwen3.5, transformers' Qwen3_5ForCausalLM,
        with its logits on 2 x 12 random ids in debug.safetensors) and its f32 GGUF: the parity fixtures are all MoE
    scripts/make_gguf_fixtures.py --llama-dir DIR --mtp build/hybridscan
        also writes tests/fixtures/gguf/qwen3_5_moe_mtp_L5 (a small Qwen3.5 MoE with a multi-token-prediction layer,
        trained 3 steps by hybridscan itself so its norms are off zero, exported to Hugging Face: transformers drops
        mtp.* weights) and its f32 GGUF with the MTP layer kept (llama.cpp's nextn tensors)
    scripts/make_gguf_fixtures.py --llama-dir DIR --hf HF_DIR --outfile FILE.gguf [--outtype f32]
        (any Hugging Face checkpoint of a byte-level model; bench/gguf_logits.sh)

DIR is a llama.cpp source tree (convert_hf_to_gguf.py, conversion/, gguf-py/). Each fixture gets a byte-level
tokenizer.json of 256 tokens (the parity models' vocabulary; id b = byte b) and a chat template, so the converter
has a tokenizer to write; it is read as a plain PreTrainedTokenizerFast (transformers' Qwen3.5 tokenizer class would
add an <|endoftext|> beyond the 256). The byte vocabulary is not one of the converter's known pre-tokenizers (it recognises them
by a hash of their output), so it is named "qwen2"; llama.cpp refuses a BPE vocabulary without merges, so it gets
one merge that no text can reach (its result is not a token). --no-mtp, except for --mtp's fixture.
"""
import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from byte_level import byte_tokenizer_json, llama_converter_for_byte_vocab  # noqa: E402

FIXTURES = ["qwen3_next_L5", "qwen3_5_L5"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_dense(out):
    """A random dense Qwen3.5 (L = 5: a remainder layer; 2 key / 4 value heads: the V-head reorder) and its logits."""
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(5)],
        full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": [1, 1, 0]},
        architectures=["Qwen3_5ForCausalLM"])
    model = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised norms and gates would make their transforms untestable
            p.add_(0.05 * torch.randn_like(p))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        logits = model(ids).logits
    save_file({"input_ids": ids.to(torch.int32).contiguous(), "logits": logits.contiguous()},
              str(out / "debug.safetensors"))


def make_mtp(out, binary):
    """A small Qwen3.5 MoE + MTP (L = 5, 2 key / 4 value heads), trained 3 steps by hybridscan, exported to HF."""
    import subprocess
    text = {"model_type": "qwen3_5_moe_text", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 5,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(5)],
            "full_attention_interval": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "norm_topk_prob": True,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "hidden_act": "silu", "tie_word_embeddings": False,
            "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "router_aux_loss_coef": 0.001,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [1, 1, 0]}}
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "tie_word_embeddings": False}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        subprocess.run([binary, "train", "--config", str(Path(tmp) / "config.json"), "--synthetic", "--steps", "3",
                        "--batch", "2", "--seq", "32", "--mtp-weight", "0.3", "--lr", "0.05", "--threads", "1",
                        "--out", str(Path(tmp) / "run"), "--quiet"], check=True)
        subprocess.run([binary, "convert", "--from", str(Path(tmp) / "run" / "checkpoint-3"), "--to", str(out),
                        "--format", "hf", "--overwrite", "--quiet"], check=True)


def patch_converter(llama):
    conv = llama_converter_for_byte_vocab(llama)
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
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--mtp", metavar="HYBRIDSCAN")
    a = ap.parse_args()
    if a.mtp:
        make_mtp(Path(a.out) / "qwen3_5_moe_mtp_L5", a.mtp)
        a.hf = str(Path(a.out) / "qwen3_5_moe_mtp_L5")
        a.outfile = str(Path(a.out) / f"qwen3_5_moe_mtp_L5.{a.outtype}.gguf")
    if a.dense:
        make_dense(Path(a.out) / "qwen3_5_dense_L5")
        a.hf = str(Path(a.out) / "qwen3_5_dense_L5")
        a.outfile = str(Path(a.out) / f"qwen3_5_dense_L5.{a.outtype}.gguf")
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
            keep_mtp = [] if a.mtp else ["--no-mtp"]
            sys.argv = ["convert_hf_to_gguf.py", str(hf), "--outtype", a.outtype, *keep_mtp, "--outfile", str(target)]
            conv.main()
            print(f"wrote {target}")


if __name__ == "__main__":
    main()
