#!/usr/bin/env python3
"""End to end: chat fine-tuning of a Qwen3.5-family checkpoint, checked against transformers (issue 26, item 2).

A tiny Qwen3.5 model (width 32, 4 layers: 3 Gated DeltaNet + 1 attention) with the REAL Qwen3.5 tokenizer
(data/tokenizers/qwen3_5/tokenizer.json) is fine-tuned a few steps with `hybridscan train --chat` on generated
conversations rendered by the real Qwen3.5 template (data/templates/Qwen3.5-4B.jinja), loss on the assistant turns,
with a chat file as --eval-data. The checkpoint is exported to Hugging Face (`hybridscan convert --format hf`), and:

1. `hybridscan tokenize --chat` of the held-out conversations gives, document by document, the ids and the mask that
   Python computes independently: transformers' `apply_chat_template`, Hugging Face `tokenizers`' encoding with its
   character offsets, assistant spans found by a regular expression on the rendered text (tests/chat_reference.py's
   `assistant_mask`; docs/chat.md says which tokens count), the separators not in the loss.
2. transformers (fp32, the exported directory) computes, conversation by conversation, the mean cross-entropy over the
   masked positions; hybridscan's held-out evaluation of the same weights on the same chat file (the final step's
   `eval_ce`, the conversations packed as documents in one window) is the same within 5e-6 relative: the fp32 loss
   bound of the transformers parity tests (tests/parity_test.cpp).
3. `--resume` of the step-2 checkpoint (which records --chat, the template and --loss-on) continues to the same losses
   as the uninterrupted run, bit for bit.
The checkpoints carry the template (chat_template.jinja, which the export keeps), so `tokenize --chat --checkpoint`
renders with it.
4. Bad input: a checkpoint with no template, an unknown role (line number in the error; counted with
   --skip-bad-lines), a conversation longer than --seq (dropped and counted): clear errors, no file written.

Usage: chat_finetune_test.py HYBRIDSCAN SOURCE_DIR. Exits 77 (skipped) without the tokenizer / template of
scripts/setup.sh or transformers.
"""
import json
import os
import random
import shutil
import re
import struct
import subprocess
import sys
import tempfile
import time

HS, SRC = sys.argv[1], sys.argv[2]
TOKENIZER = os.path.join(SRC, "data/tokenizers/qwen3_5/tokenizer.json")
TEMPLATE = os.path.join(SRC, "data/templates/Qwen3.5-4B.jinja")
for f in (TOKENIZER, TEMPLATE):
    if not os.path.exists(f):
        print("skipped: %s is missing (scripts/setup.sh fetches it)" % f)
        sys.exit(77)
try:
    import torch
    import tokenizers
    import transformers
    transformers.logging.set_verbosity_error()
except ImportError as e:
    print("skipped: %s" % e)
    sys.exit(77)
sys.path.insert(0, os.path.join(SRC, "tests"))
from chat_reference import assistant_mask  # noqa: E402

WORDS = ["hello", "the", "model", "Qwen", "日本語", "é", "code", "def f(x):", "42", "why?", "Sure.", "\n", "🎉", "  "]


def text(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10)))


def conversations(seed, n):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        m = []
        if rng.random() < 0.5:
            m.append({"role": "system", "content": text(rng)})
        for _ in range(rng.randint(1, 3)):
            m.append({"role": "user", "content": text(rng)})
            a = {"role": "assistant", "content": text(rng)}
            if rng.random() < 0.3:
                a["reasoning_content"] = text(rng)
            m.append(a)
        out.append(m)
    return out


def write_jsonl(path, convs):
    with open(path, "w", encoding="utf-8") as f:
        for m in convs:
            f.write(json.dumps({"messages": m}, ensure_ascii=False) + "\n")


def run(*args, ok=True):
    t0 = time.time()
    p = subprocess.run([HS, *args], capture_output=True, text=True)
    if ok and p.returncode != 0:
        sys.exit("FAIL: %s\n%s%s" % (" ".join(args), p.stdout, p.stderr))
    if not ok and p.returncode == 0:
        sys.exit("FAIL: expected an error from %s\n%s" % (" ".join(args), p.stdout))
    print("  [%.1f s] hybridscan %s" % (time.time() - t0, args[0]), flush=True)
    return p


def read_token_file(path):
    """Documents of a hybridscan token file (docs/token_format.md) as (ids, mask) lists, split at the separators."""
    data = open(path, "rb").read()
    assert data[:8] == b"HSTOKENS"
    version, width, _, vocab, count, documents = struct.unpack_from("<IIQqqq", data, 8)
    flags = struct.unpack_from("<I", data, 60)[0]
    assert version == 2 and flags & 1, "a chat token file is version 2 with a loss mask"
    offset = (72 + 2 * vocab + 63) // 64 * 64
    ids = list(struct.unpack_from("<%d%s" % (count, "H" if width == 2 else "I"), data, offset))
    mask = list(data[offset + count * width: offset + count * width + count])
    assert len(mask) == count
    return ids, mask, documents


def main():
    tmp = tempfile.mkdtemp(prefix="hs-chat-e2e-")
    train_convs, eval_convs = conversations(1, 24), conversations(2, 8)
    write_jsonl(os.path.join(tmp, "train.jsonl"), train_convs)
    write_jsonl(os.path.join(tmp, "eval.jsonl"), eval_convs)
    cfg = json.load(open(os.path.join(SRC, "tests/fixtures/gguf/qwen3_5_dense_L5/config.json")))
    cfg.update(vocab_size=248320, num_hidden_layers=4, layer_types=cfg["layer_types"][:4], hidden_size=32,
               intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=1,
               linear_num_value_heads=2)
    json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"))
    seq = 640
    common = ["--chat", os.path.join(tmp, "train.jsonl"), "--eval-data", os.path.join(tmp, "eval.jsonl"),
              "--eval-every", "4", "--eval-batches", "1", "--compute-dtype", "fp32", "--json", "--quiet"]
    p = run("train", "--model", os.path.join(tmp, "config.json"), "--tokenizer", TOKENIZER, "--chat-template",
            TEMPLATE, "--steps", "4", "--batch", "1", "--seq", str(seq), "--lr", "3e-3", "--warmup", "1", "--seed",
            "3", "--save-every", "2", "--out", os.path.join(tmp, "run"), *common)
    full = json.loads(p.stdout.strip().splitlines()[-1])
    print("train --chat: losses %s, held-out %.6f" % (full["losses"], full["eval_ce"]))
    assert full["losses"][-1] < full["losses"][0], "fine-tuning lowers the loss"

    # 3. --resume from step 2: the options bring back --chat, its template and --loss-on.
    p = run("train", "--resume", os.path.join(tmp, "run/checkpoint-2"), "--steps", "4", "--json", "--quiet",
            "--out", os.path.join(tmp, "resumed"))
    resumed = json.loads(p.stdout.strip().splitlines()[-1])
    assert resumed["losses"] == full["losses"][2:], "resume: %s vs %s" % (resumed["losses"], full["losses"][2:])
    assert resumed["eval_ce"] == full["eval_ce"], "resume: held-out %r vs %r" % (resumed["eval_ce"], full["eval_ce"])
    print("resume from step 2: losses %s (the same bits)" % resumed["losses"])

    # 1. tokenize --chat against an independent Python computation of ids and masks.
    tok_path = os.path.join(tmp, "eval.tok")
    # The checkpoint carries the tokenizer and the template it was trained with.
    run("tokenize", "--chat", os.path.join(tmp, "eval.jsonl"), "--checkpoint", os.path.join(tmp, "run/checkpoint-4"),
        "--out", tok_path, "--quiet")
    ids, mask, documents = read_token_file(tok_path)
    assert documents == len(eval_convs)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    hf_tok.chat_template = open(TEMPLATE, encoding="utf-8").read()
    hf_dir = os.path.join(tmp, "hf")
    run("convert", "--from", os.path.join(tmp, "run/checkpoint-4"), "--to", hf_dir, "--format", "hf", "--quiet")
    exported = open(os.path.join(hf_dir, "chat_template.jinja"), encoding="utf-8").read()
    assert exported == hf_tok.chat_template, "the export carries the template the run rendered with"
    raw = tokenizers.Tokenizer.from_file(TOKENIZER)
    sep = raw.token_to_id("<|endoftext|>")
    expect_ids, expect_mask, per_conv = [], [], []
    for k, m in enumerate(eval_convs):
        rendered = hf_tok.apply_chat_template(m, tokenize=False)
        enc = raw.encode(rendered, add_special_tokens=False)
        cm = assistant_mask(rendered, enc)
        per_conv.append((enc.ids, cm))
        if k:
            expect_ids.append(sep)
            expect_mask.append(0)  # under --loss-on assistant the separator is not predicted
        expect_ids += enc.ids
        expect_mask += cm
    assert ids == expect_ids, "ids differ from apply_chat_template + tokenizers"
    assert mask == expect_mask, "masks differ from the independent span computation"
    assert len(ids) <= seq, "the held-out conversations fit one evaluation window"
    print("tokenize --chat: %d documents, %d tokens, %d in the loss: ids and masks equal Python's"
          % (documents, len(ids), sum(mask)))

    # 2. transformers' masked cross-entropy of the exported checkpoint.
    hcfg = transformers.AutoConfig.from_pretrained(hf_dir)
    cls = (transformers.AutoModelForImageTextToText if hcfg.model_type in ("qwen3_5", "qwen3_5_moe")
           else transformers.AutoModelForCausalLM)
    t0 = time.time()
    if hasattr(hcfg, "vision_config"):
        hcfg.vision_config.depth = 1  # the export's vision tower is not used (nor stored): keep its random one small
    model = cls.from_pretrained(hf_dir, config=hcfg, dtype=torch.float32).eval()
    print("  [%.1f s] transformers loads %s" % (time.time() - t0, type(model).__name__), flush=True)
    total, count = 0.0, 0
    with torch.no_grad():
        for conv_ids, conv_mask in per_conv:
            x = torch.tensor([conv_ids])
            logp = torch.log_softmax(model(input_ids=x).logits[0].double(), dim=-1)
            for i in range(1, len(conv_ids)):
                if conv_mask[i]:
                    total -= logp[i - 1, conv_ids[i]].item()
                    count += 1
    ref = total / count
    rel = abs(full["eval_ce"] - ref) / abs(ref)
    print("masked cross-entropy over %d assistant tokens of %d conversations: transformers %.8f (%s), hybridscan "
          "%.8f: relative difference %.2e (bound 5e-6)" % (count, len(per_conv), ref, type(model).__name__,
                                                           full["eval_ce"], rel))
    assert count == sum(mask), "the loss counts the masked tokens"
    assert rel < 5e-6, "hybridscan's masked loss differs from transformers'"

    # 4. Bad input.
    out = os.path.join(tmp, "bad.tok")
    bare = os.path.join(tmp, "bare")  # a checkpoint directory with a tokenizer and no template
    os.makedirs(bare)
    shutil.copy(TOKENIZER, bare)
    p = run("tokenize", "--chat", os.path.join(tmp, "eval.jsonl"), "--checkpoint", bare, "--out", out, ok=False)
    assert "chat template" in p.stderr and not os.path.exists(out), p.stderr
    bad = os.path.join(tmp, "bad.jsonl")
    with open(bad, "w") as f:
        f.write(json.dumps({"messages": eval_convs[0]}) + "\n")
        f.write(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
        f.write("{not json\n")
    p = run("tokenize", "--chat", bad, "--tokenizer", TOKENIZER, "--chat-template", TEMPLATE, "--out", out, ok=False)
    assert "bad.jsonl:2" in p.stderr and "robot" in p.stderr and not os.path.exists(out), p.stderr
    p = run("tokenize", "--chat", bad, "--tokenizer", TOKENIZER, "--chat-template", TEMPLATE, "--out", out,
            "--skip-bad-lines", "--quiet")
    assert "2 bad lines skipped" in p.stdout and os.path.exists(out), p.stdout
    p = run("tokenize", "--chat", os.path.join(tmp, "eval.jsonl"), "--tokenizer", TOKENIZER, "--chat-template",
            TEMPLATE, "--out", out, "--seq", "60", "--quiet")
    longer = sum(len(c[0]) > 60 for c in per_conv)
    assert re.search(r"; %d dropped as longer than the window" % longer, p.stdout), p.stdout
    print("bad input: %s" % p.stdout.strip())
    shutil.rmtree(tmp)
    print("PASS")


main()
