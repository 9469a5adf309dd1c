#!/usr/bin/env python3
"""The Python side of tests/mtp_test.cpp: the multi-token-prediction layer of a Qwen3-Next checkpoint, computed
from its published definition (vLLM's Qwen3NextMultiTokenPredictor: docs/model.md, "Multi-token prediction") on top
of transformers' own decoder and decoder layer, in fp32 with torch autograd.

    mtp_reference.py CHECKPOINT_DIR BATCH_FILE OUT_DIR

CHECKPOINT_DIR: a Hugging Face directory (config.json with num_nextn_predict_layers 1, model.safetensors with the
mtp.* tensors, experts fused). BATCH_FILE: int32 little-endian batch, seq, then inputs [batch*seq] and targets
[batch*seq] (targets < 0 ignored). OUT_DIR/mtp.json: the MTP layer's mean cross-entropy of x_{t+2} and its count;
OUT_DIR/grads.safetensors: d(that mean)/d(every parameter), under the checkpoint's names.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

torch.manual_seed(0)
ckpt, batch_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
raw = np.fromfile(batch_file, dtype="<i4")
B, T = int(raw[0]), int(raw[1])
inputs = torch.tensor(raw[2:2 + B * T].reshape(B, T), dtype=torch.long)
targets = torch.tensor(raw[2 + B * T:2 + 2 * B * T].reshape(B, T), dtype=torch.long)

config = AutoConfig.from_pretrained(ckpt)
config._attn_implementation = "eager"
model = AutoModelForCausalLM.from_pretrained(ckpt, config=config, dtype=torch.float32, attn_implementation="eager")
model.train(False)
tensors = load_file(os.path.join(ckpt, "model.safetensors"))

# The MTP layer's modules: three zero-centred RMSNorms, fc without bias, and one full-attention decoder layer of
# the family (transformers' own class, built at a full-attention layer index so that it gets self_attn).
H = config.hidden_size
full_idx = config.layer_types.index("full_attention")
layer = Qwen3NextDecoderLayer(config, full_idx).float()
layer.load_state_dict({k: tensors["mtp.layers.0." + k] for k in layer.state_dict()}, strict=True)
norms = {}
for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
    m = Qwen3NextRMSNorm(H, eps=config.rms_norm_eps)
    m.load_state_dict({"weight": tensors[f"mtp.{n}.weight"]})
    norms[n] = m
fc = torch.nn.Parameter(tensors["mtp.fc.weight"].clone())

# The decoder's last hidden state h_t as the MTP layer reads it: the output of its final norm (vLLM's
# Qwen3NextModel.forward returns the normed state, which its MTP proposer passes on; llama.cpp's qwen3next graph
# feeds build_norm(cur, output_norm) to its nextn layer).
captured = {}
model.model.norm.register_forward_hook(lambda mod, args, out: captured.__setitem__("h", out))
model.model(input_ids=inputs)
h = captured["h"]

# Depth 1: position t reads x_{t+1} and predicts x_{t+2}; the last position's token after next is outside.
next_ids = torch.cat([inputs[:, 1:], targets[:, -1:].clamp(min=0)], dim=1)
mtp_targets = torch.cat([targets[:, 1:], torch.full((B, 1), -1, dtype=torch.long)], dim=1)
mtp_targets[targets < 0] = -1  # x_{t+2} counts only where x_{t+1} does (a document's end, an untrained span)
e = norms["pre_fc_norm_embedding"](model.model.embed_tokens(next_ids))
u = norms["pre_fc_norm_hidden"](h)
m = F.linear(torch.cat([e, u], dim=-1), fc)
pos = torch.arange(T).unsqueeze(0).expand(B, T)
cos_sin = model.model.rotary_emb(m, pos)
mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
m = layer(m, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
if isinstance(m, tuple):
    m = m[0]
logits = model.lm_head(norms["norm"](m)).float()
counted = mtp_targets >= 0
loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mtp_targets.reshape(-1), ignore_index=-1,
                       reduction="sum") / counted.sum()
loss.backward()

grads = {}  # (a parameter no path reaches, had there been one, gets a zero gradient)
for name, p in model.named_parameters():
    grads[name] = (p.grad if p.grad is not None else torch.zeros_like(p)).contiguous()
for name, p in layer.named_parameters():
    grads["mtp.layers.0." + name] = (p.grad if p.grad is not None else torch.zeros_like(p)).contiguous()
for n, mod in norms.items():
    grads[f"mtp.{n}.weight"] = mod.weight.grad.contiguous()
grads["mtp.fc.weight"] = fc.grad.contiguous()
os.makedirs(out, exist_ok=True)
save_file(grads, os.path.join(out, "grads.safetensors"))
with open(os.path.join(out, "mtp.json"), "w") as f:
    json.dump({"ce": float(loss), "count": int(counted.sum())}, f)
