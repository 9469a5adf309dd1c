#!/usr/bin/env bash
# Peak memory of converting a multi-GB checkpoint: writes a synthetic Qwen3-Next Hugging Face checkpoint of about
# SIZE_GB (bf16, sharded at 1 GB, random values), converts it to the native stacked layout and back, and reports each
# direction's peak resident set size (GNU time) against the checkpoint size. The converter streams spans of the
# memory-mapped source and drops their pages after use, so its peak should stay far below the checkpoint size.
#   bench/convert_memory.sh [WORKDIR]      (SIZE_GB=3 by default; needs python3 with torch + safetensors, ~4x SIZE_GB disk)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${HYBRIDSCAN:-build/hybridscan}
[ -x "$B" ] || { echo "build hybridscan first: scripts/setup.sh" >&2; exit 2; }
W=${1:-/tmp/hs_convert_bench}
SIZE_GB=${SIZE_GB:-3}
rm -rf "$W" && mkdir -p "$W"
python3 - "$W/hf" "$SIZE_GB" <<'PY'
import json, os, sys, torch
from safetensors.torch import save_file
out, size_gb = sys.argv[1], float(sys.argv[2])
os.makedirs(out)
H, I, E, V = 1024, 512, 64, 32000
per_layer = E * 3 * I * H * 2
L = max(4, int(size_gb * 1e9 / per_layer))
cfg = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "hidden_size": H, "num_hidden_layers": L,
       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "partial_rotary_factor": 0.25,
       "rope_theta": 1e7, "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 128,
       "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": E, "num_experts_per_tok": 4,
       "moe_intermediate_size": I, "shared_expert_intermediate_size": I, "norm_topk_prob": True, "vocab_size": V,
       "rms_norm_eps": 1e-6, "full_attention_interval": 4, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
json.dump(cfg, open(f"{out}/config.json", "w"), indent=2)
def r(*shape): return torch.randn(*shape, dtype=torch.bfloat16)
kd, vd, hv = 4 * 128, 8 * 128, 8
def layer(i):
    p = f"model.layers.{i}."
    t = {p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
         p + "mlp.gate.weight": r(E, H), p + "mlp.shared_expert_gate.weight": r(1, H),
         p + "mlp.shared_expert.gate_proj.weight": r(I, H), p + "mlp.shared_expert.up_proj.weight": r(I, H),
         p + "mlp.shared_expert.down_proj.weight": r(H, I)}
    for e in range(E):
        t[p + f"mlp.experts.{e}.gate_proj.weight"] = r(I, H)
        t[p + f"mlp.experts.{e}.up_proj.weight"] = r(I, H)
        t[p + f"mlp.experts.{e}.down_proj.weight"] = r(H, I)
    if (i + 1) % 4 == 0:
        t.update({p + "self_attn.q_proj.weight": r(8 * 256, H), p + "self_attn.k_proj.weight": r(256, H),
                  p + "self_attn.v_proj.weight": r(256, H), p + "self_attn.o_proj.weight": r(H, 8 * 128),
                  p + "self_attn.q_norm.weight": r(128), p + "self_attn.k_norm.weight": r(128)})
    else:
        t.update({p + "linear_attn.in_proj_qkvz.weight": r(2 * kd + 2 * vd, H), p + "linear_attn.in_proj_ba.weight": r(2 * hv, H),
                  p + "linear_attn.conv1d.weight": r(2 * kd + vd, 1, 4), p + "linear_attn.A_log": r(hv).float(),
                  p + "linear_attn.dt_bias": r(hv), p + "linear_attn.norm.weight": r(128).float(),
                  p + "linear_attn.out_proj.weight": r(H, vd)})
    return t
weight_map, shards, total = {}, [], 0
globals_ = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H), "lm_head.weight": r(V, H)}
groups = [globals_] + [None] * L
n = L + 1
for k in range(n):
    t = groups[k] if k == 0 else layer(k - 1)
    name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    save_file(t, f"{out}/{name}", metadata={"format": "pt"})
    for key, v in t.items():
        weight_map[key] = name
        total += v.numel() * v.element_size()
    del t
json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, open(f"{out}/model.safetensors.index.json", "w"), indent=2)
print(f"synthetic checkpoint: {L} layers, {total / 1e9:.2f} GB in {n} shards")
PY
size=$(du -sb "$W/hf" | cut -f1)
measure() {
  /usr/bin/time -f "%M %e" -o "$W/time.txt" "$B" convert --quiet "$@" > /dev/null
  read -r kb secs < "$W/time.txt"
  printf "%s -> %s: peak RSS %8.1f MiB (%5.1f%% of the %.2f GB checkpoint), %6.1f s\n" "$(basename "$2")" "$(basename "$4")" \
    "$(echo "$kb/1024" | bc -l)" "$(echo "$kb*1024*100/$size" | bc -l)" "$(echo "$size/1000000000" | bc -l)" "$secs"
}
measure --from "$W/hf" --to "$W/native"
measure --from "$W/native" --to "$W/hf2" --format hf --max-shard-size 1GB
python3 - "$W/hf" "$W/hf2" <<'PY'
import sys
from safetensors import safe_open
import json, os
def tensors(d):
    idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    return idx
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
assert set(a) == set(b), "tensor names differ"
import random
random.seed(0)
for name in random.sample(sorted(a), 40):
    with safe_open(os.path.join(sys.argv[1], a[name]), "pt") as fa, safe_open(os.path.join(sys.argv[2], b[name]), "pt") as fb:
        x, y = fa.get_tensor(name), fb.get_tensor(name)
        assert x.dtype == y.dtype and x.shape == y.shape and bool((x.view(-1).view(dtype=__import__('torch').int16) == y.view(-1).view(dtype=__import__('torch').int16)).all()), name
print(f"round trip: {len(a)} tensors, same names; 40 sampled tensors byte-identical")
PY
rm -rf "$W"
