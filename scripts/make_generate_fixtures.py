#!/usr/bin/env python3
"""Greedy-generation fixtures from Hugging Face `transformers` for hybridscan's decoding tests.

The random tiny checkpoints are the training-parity ones (tests/fixtures/parity/<case>/, written by
make_parity_fixtures.py); this script only adds what transformers' own incremental decoding produces on them:

    <out>/<case>.safetensors   prompt.<i> (int32 [n]), tokens.<i> (int32 [NEW]: greedy `generate`, its KV cache and
                               recurrent state), scores.<i> (fp32 [NEW, vocab]: the logits each token was chosen
                               from), and in the metadata min_margin.<i>, the smallest gap between the best and the
                               second-best logit over the steps (a greedy choice closer than fp32 noise would be
                               ambiguous)

Run: python3 scripts/make_generate_fixtures.py --out tests/fixtures/generate
Seeded, single-threaded: the same torch/transformers versions reproduce the files bit for bit.
"""

import argparse
import os

import torch
import transformers
from make_parity_fixtures import write_safetensors
from transformers import AutoConfig, Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM

CASES = ("qwen3_next_L4", "qwen3_next_L5", "qwen3_5_L4", "qwen3_5_L7")  # L5, L7: a remainder after the periods
PROMPT_LENGTHS = (1, 7, 70)  # 70: the prefill crosses a 64-token delta-rule chunk
NEW_TOKENS = 40
PROMPT_SEED = 1313


def load(case_dir):
    config = AutoConfig.from_pretrained(case_dir)
    cls = Qwen3NextForCausalLM if config.model_type == "qwen3_next" else Qwen3_5MoeForConditionalGeneration
    model = cls.from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager",
                                experts_implementation="eager")
    model.eval()
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parity", default="tests/fixtures/parity")
    parser.add_argument("--out", default="tests/fixtures/generate")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    for case in CASES:
        model = load(os.path.join(args.parity, case))
        vocab = model.config.get_text_config().vocab_size
        gen = torch.Generator().manual_seed(PROMPT_SEED)
        tensors, metadata = {}, {"case": case, "new_tokens": str(NEW_TOKENS), "torch": torch.__version__,
                                 "transformers": transformers.__version__,
                                 "generate": "do_sample=False, eos disabled, use_cache=True (its default)"}
        for i, n in enumerate(PROMPT_LENGTHS):
            prompt = torch.randint(0, vocab, (1, n), generator=gen)
            with torch.no_grad():
                out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                                     pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            new = out.sequences[0, n:]
            scores = torch.stack([s[0] for s in out.scores]).float()
            assert new.numel() == NEW_TOKENS and torch.equal(scores.argmax(-1), new)
            top2 = scores.topk(2, dim=-1).values
            tensors[f"prompt.{i}"] = prompt[0].to(torch.int32).contiguous()
            tensors[f"tokens.{i}"] = new.to(torch.int32).contiguous()
            tensors[f"scores.{i}"] = scores.contiguous()
            metadata[f"min_margin.{i}"] = f"{(top2[:, 0] - top2[:, 1]).min().item():.3e}"
        write_safetensors(os.path.join(args.out, f"{case}.safetensors"), tensors, metadata)
        print(case, {k: v for k, v in metadata.items() if k.startswith("min_margin")})


if __name__ == "__main__":
    main()
