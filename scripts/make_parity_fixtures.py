#!/usr/bin/env python3
"""Reference fixtures from Hugging Face `transformers` for hybridscan's parity tests.

The llm.c "debug state" pattern: for each model family and depth, build a tiny random fp32 model, run one
forward/backward on a fixed batch and write everything a C++ test needs to compare tensor by tensor:

    <out>/<family>_L<n>/config.json         as save_pretrained writes it
    <out>/<family>_L<n>/model.safetensors   as save_pretrained writes it (transformers 5.x: safetensors only)
    <out>/<family>_L<n>/debug.safetensors   input_ids, logits, loss, ce_loss, aux_loss, grad.<name>,
                                            aux_grad.<router name>, train_losses (3 AdamW steps)

`grad.<name>` uses exactly the tensor names, shapes and dtypes of model.safetensors (transformers' save-time
conversion is applied to the gradients too, so per-expert checkpoint tensors get per-expert gradients).
Tensors that take no part in a text-only forward (the Qwen3.5 vision tower, `model.visual.*`) have no
gradient and no `grad.` entry.

Run: python3 scripts/make_parity_fixtures.py --out tests/fixtures/parity
Everything is seeded; the same transformers/torch versions reproduce the files bit for bit.
Findings and the exact conventions: docs/transformers_notes.md.
"""

import argparse
import copy
import json
import os
import shutil
import struct
import tempfile

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.core_model_loading import revert_weight_conversion
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

LAYER_COUNTS = (4, 5, 7)  # 5 and 7 leave a remainder of 1 and 3 linear-attention layers after whole periods
BATCH, SEQ = 2, 80  # 80 tokens: one full 64-token delta-rule chunk plus a padded partial one
INPUT_SEED = 20240601
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TRAIN_STEPS = 3
SEED_CANDIDATES = 32
MIN_ROUTING_MARGIN = 5e-5  # ~8x the fp32 error of the router probabilities (6e-6 against fp64)

# hybridscan's `tiny` preset. rd = int(16 * 0.25) = 4: two rotary frequencies, enough to tell the NeoX
# half split from an interleaved pairing, so the real factor 0.25 is kept.
TINY_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    rms_norm_eps=1e-6,
    router_aux_loss_coef=0.001,
    output_router_logits=True,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    full_attention_interval=4,
)
ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)
# The real Qwen3.5 configs carry mrope_section [11, 11, 10] (sums to rd/2 = 32); scaled to rd/2 = 2 here.
# Text-only positions make the three streams equal, so the section split cannot change any number.
MROPE = dict(mrope_interleaved=True, mrope_section=[1, 1, 0])
# Smallest vision tower transformers accepts; present only so the checkpoint has real `model.visual.*` names.
TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=16,
    num_heads=2,
    out_hidden_size=64,
    patch_size=2,
    temporal_patch_size=1,
    spatial_merge_size=1,
    num_position_embeddings=4,
)

FAMILIES = ("qwen3_next", "qwen3_5")


def build_model(family, num_layers, seed):
    torch.manual_seed(seed)
    text = dict(TINY_TEXT, num_hidden_layers=num_layers)
    if family == "qwen3_next":
        config = Qwen3NextConfig(**text, rope_parameters=dict(ROPE), norm_topk_prob=True)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = Qwen3NextForCausalLM(config)
        text_config = config
    else:
        config = Qwen3_5MoeConfig(text_config=dict(text, rope_parameters=dict(ROPE, **MROPE)), vision_config=TINY_VISION)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = Qwen3_5MoeForConditionalGeneration(config)
        text_config = config.text_config
    expected = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    assert text_config.layer_types == expected, text_config.layer_types
    perturb(model, torch.Generator().manual_seed(seed + 1))
    return model


def perturb(model, gen):
    """Re-draw every text-decoder parameter so that every part moves the logits by O(1).

    transformers' init leaves the zero-centred norms at 0, the gated norm at 1, dt_bias at 1 and A up to 16
    (which forgets the state within a token); a parity test against such weights cannot see a 1+w vs w slip,
    a wrong interleave or a broken recurrence. Linear weights get std 1/sqrt(fan_in).
    """

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual."):
                continue  # not part of the text decoder; left at transformers' (seeded) init
            if name.endswith("linear_attn.norm.weight"):
                value = normal(p.shape, 0.3, mean=1.0)  # plain weight around 1
            elif name.endswith("norm.weight"):
                value = normal(p.shape, 0.3)  # zero-centred: runtime scale 1 + w
            elif name.endswith("A_log"):
                # A in [0.02, 1]: per-step decays from ~0.999 (memory across the chunk boundary) to ~0.03
                value = torch.empty(p.shape).uniform_(0.02, 1.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                value = normal(p.shape, 1.0)
            elif name.endswith("conv1d.weight"):
                value = normal(p.shape, 0.5)
            elif name.endswith("embed_tokens.weight"):
                value = normal(p.shape, 1.0)
            elif name.endswith("mlp.gate.weight"):
                value = normal(p.shape, 1.5 / p.shape[1] ** 0.5)  # router logits of std ~1.5: varied top-2
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                value = normal(p.shape, 1.0 / p.shape[2] ** 0.5)  # [E, out, in]
            elif p.dim() == 2:
                value = normal(p.shape, 1.0 / p.shape[1] ** 0.5)
            else:
                raise AssertionError(f"no init rule for {name} {tuple(p.shape)}")
            p.copy_(value)


def make_inputs(vocab_size):
    gen = torch.Generator().manual_seed(INPUT_SEED)
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=gen)


def text_config_of(model):
    return model.config.text_config if hasattr(model.config, "text_config") else model.config


def forward(model, input_ids):
    """One training forward as transformers runs it: labels = input_ids, shifted inside the loss."""
    out = model(input_ids=input_ids, labels=input_ids, output_router_logits=True)
    vocab = text_config_of(model).vocab_size
    # ForCausalLMLoss: pad labels with -100 on the right and drop the first, so position t predicts
    # token t+1; the last position of each row is ignored. Mean over the B*(T-1) remaining tokens.
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab).float(), input_ids[:, 1:].reshape(-1))
    coef = text_config_of(model).router_aux_loss_coef
    assert torch.allclose(out.loss, ce + coef * out.aux_loss, rtol=1e-6, atol=0), (out.loss, ce, out.aux_loss)
    return out, ce


def checkpoint_names(model, tensors):
    """Names as save_pretrained writes them: transformers 5.x reverts its load-time conversions on save
    (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` instead of fused `gate_up_proj`/`down_proj`)."""
    return revert_weight_conversion(model, dict(tensors))


def sensitivity(model, family, input_ids, reference_logits):
    """Relative logit change under simulated implementation slips; each must be clearly visible."""
    tc = text_config_of(model)
    hk, hv, dk, dv = tc.linear_num_key_heads, tc.linear_num_value_heads, tc.linear_key_head_dim, tc.linear_value_head_dim
    nh, hd = tc.num_attention_heads, tc.head_dim
    r = hv // hk

    def qkvz_plain_read_as_interleaved():
        key_dim, value_dim = hk * dk, hv * dv
        rows = []
        for g in range(hk):
            rows += list(range(g * dk, (g + 1) * dk))
            rows += list(range(key_dim + g * dk, key_dim + (g + 1) * dk))
            rows += list(range(2 * key_dim + g * r * dv, 2 * key_dim + (g + 1) * r * dv))
            rows += list(range(2 * key_dim + value_dim + g * r * dv, 2 * key_dim + value_dim + (g + 1) * r * dv))
        return torch.tensor(rows)

    def q_gate_halves():
        rows = []
        for h in range(nh):
            rows += list(range(h * hd, (h + 1) * hd)) + list(range(nh * hd + h * hd, nh * hd + (h + 1) * hd))
        return torch.tensor(rows)

    def ba_plain_read_as_interleaved():
        rows = []
        for g in range(hk):
            rows += list(range(g * r, (g + 1) * r)) + list(range(hv + g * r, hv + (g + 1) * r))
        return torch.tensor(rows)

    # Value head j of a model that tiles key heads (reads key head j % hk instead of j // r) computes what
    # transformers' head sigma(j) computes after all value-head parameters are relabelled by sigma.
    sigma = torch.tensor([(j % r) * hk + j // r for j in range(hv)])
    value_rows = (sigma[:, None] * dv + torch.arange(dv)).reshape(-1)
    qkv_rows = torch.cat([torch.arange(2 * hk * dk), 2 * hk * dk + value_rows])

    def tiled_value_heads(name, p):
        if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
            return p[qkv_rows]
        if name.endswith("in_proj_z.weight"):
            return p[value_rows]
        if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            return p[sigma]
        if name.endswith("linear_attn.out_proj.weight"):
            return p[:, value_rows]
        return None

    def zero_centred(name):
        return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")

    slips = {
        "zero-centred norms applied as w, not 1+w": lambda n, p: p - 1 if zero_centred(n) else None,
        "gated GDN norm applied as 1+w": lambda n, p: p + 1 if n.endswith("linear_attn.norm.weight") else None,
        "conv taps reversed": lambda n, p: p.flip(-1) if n.endswith("conv1d.weight") else None,
        "no state decay (g = 0)": lambda n, p: torch.full_like(p, -60.0) if n.endswith("A_log") else None,
        "q/gate split as matrix halves": lambda n, p: p[q_gate_halves()] if n.endswith("q_proj.weight") else None,
    }
    if family == "qwen3_next":
        slips["in_proj_qkvz read as plain [q|k|v|z]"] = (
            lambda n, p: p[qkvz_plain_read_as_interleaved()] if n.endswith("in_proj_qkvz.weight") else None
        )
        slips["in_proj_ba read as plain [b|a]"] = (
            lambda n, p: p[ba_plain_read_as_interleaved()] if n.endswith("in_proj_ba.weight") else None
        )
    else:
        slips["GDN key heads tiled, not repeat_interleave"] = tiled_value_heads
    results = {}
    for label, edit in slips.items():
        slipped = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in slipped.named_parameters():
                new = edit(name, p)
                if new is not None:
                    p.copy_(new)
            logits = slipped(input_ids=input_ids).logits
        results[label] = ((logits - reference_logits).norm() / reference_logits.norm()).item()
    return results


def chunk_vs_recurrent(family, model, input_ids):
    """Run the whole model with transformers' recurrent delta-rule fallback in place of the chunked one."""
    module = modeling_qwen3_next if family == "qwen3_next" else modeling_qwen3_5_moe
    captured = []
    chunked = module.torch_chunk_gated_delta_rule

    def capturing(*args, **kwargs):
        captured.append((args, kwargs))
        return chunked(*args, **kwargs)

    with torch.no_grad():
        module.torch_chunk_gated_delta_rule = capturing
        try:
            logits_chunk = model(input_ids=input_ids).logits
        finally:
            module.torch_chunk_gated_delta_rule = chunked
        module.torch_chunk_gated_delta_rule = module.torch_recurrent_gated_delta_rule
        try:
            logits_rec = model(input_ids=input_ids).logits
        finally:
            module.torch_chunk_gated_delta_rule = chunked
        core_diff = 0.0
        for args, kwargs in captured:
            kw = {k: v for k, v in kwargs.items() if k != "cu_seqlens"}
            a = chunked(*args, **kw)[0]
            b = module.torch_recurrent_gated_delta_rule(*args, **kw)[0]
            core_diff = max(core_diff, (a - b).abs().max().item() / b.abs().max().item())
    assert captured, "chunked delta rule was not called"
    return len(captured), core_diff, (logits_chunk - logits_rec).abs().max().item()


def aux_share_of_router_grad(model, input_ids):
    """|d(coef*aux)/dW_router| / |dloss/dW_router|: how visible a missing aux term is in the router grads."""
    model = copy.deepcopy(model)
    model.train()
    out, ce = forward(model, input_ids)
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    g_total = torch.autograd.grad(out.loss, routers, retain_graph=True)
    g_ce = torch.autograd.grad(ce, routers)
    diff = sum(((a - b) ** 2).sum() for a, b in zip(g_total, g_ce)).sqrt()
    return (diff / sum((a ** 2).sum() for a in g_total).sqrt()).item()


def routing_margin(out, top_k):
    """Smallest gap between the k-th and (k+1)-th router probability over all tokens and MoE layers.

    Only the selected set matters (the renormalised sum is order-free), and a gap smaller than the fp32
    error of the probabilities (~6e-6 here, measured against fp64) lets a correct implementation pick
    a different expert than transformers did."""
    gaps = []
    for logits in out.router_logits:
        top = logits.detach().softmax(-1).topk(top_k + 1, dim=-1).values
        gaps.append((top[:, top_k - 1] - top[:, top_k]).min())
    return min(gaps).item()


def train_trace(model, input_ids):
    """AdamW steps on the same batch (as llm.c does); losses[k] is the loss before step k.
    Also returns the smallest routing margin seen in any of the steps' forwards."""
    model = copy.deepcopy(model)
    model.train()
    params = [p for n, p in model.named_parameters() if not n.startswith("model.visual.")]
    opt = torch.optim.AdamW(params, foreach=False, **ADAMW)
    losses, margin = [], float("inf")
    for _ in range(TRAIN_STEPS):
        opt.zero_grad(set_to_none=True)
        out, _ = forward(model, input_ids)
        margin = min(margin, routing_margin(out, text_config_of(model).num_experts_per_tok))
        out.loss.backward()
        losses.append(out.loss.item())
        opt.step()
    return torch.tensor(losses, dtype=torch.float32), margin


def write_safetensors(path, tensors, metadata):
    """safetensors.torch.save_file emits __metadata__ in hash order; this writer is byte-reproducible:
    metadata keys and tensors sorted by name, header padded with spaces to a multiple of 8."""
    dtypes = {torch.float32: "F32", torch.int32: "I32"}
    header = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        blob = t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def spec_reference(config, weights, input_ids):
    """The decoder written out from docs/model.md in float64, independently of transformers'
    code (recurrent delta rule, dense expert loop). Returns logits, ce, aux, loss."""
    tc = config.get("text_config", config)
    prefix = "model.language_model." if "text_config" in config else "model."
    W = weights
    H, V, eps = tc["hidden_size"], tc["vocab_size"], tc["rms_norm_eps"]
    hk, hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv, K = tc["linear_key_head_dim"], tc["linear_value_head_dim"], tc["linear_conv_kernel_dim"]
    r = hv // hk
    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    rd = int(hd * tc["rope_parameters"]["partial_rotary_factor"])
    theta = tc["rope_parameters"]["rope_theta"]
    E, top_k = tc["num_experts"], tc["num_experts_per_tok"]
    B, T = input_ids.shape

    def rms_zero_centred(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)

    def linear(x, w):
        return x @ w.T

    def l2norm(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    def gated_delta_net(x, p):
        if p + "in_proj_qkvz.weight" in W:  # Qwen3-Next: per key head [q k v z] and [b a]
            qkvz = linear(x, W[p + "in_proj_qkvz.weight"]).view(B, T, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], -1)
            ba = linear(x, W[p + "in_proj_ba.weight"]).view(B, T, hk, 2 * r)
            b, a = ba[..., :r].reshape(B, T, hv), ba[..., r:].reshape(B, T, hv)
            mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], -1)
        else:  # Qwen3.5: plain [q all | k all | v all], z, b, a
            mixed = linear(x, W[p + "in_proj_qkv.weight"])
            z = linear(x, W[p + "in_proj_z.weight"])
            b, a = linear(x, W[p + "in_proj_b.weight"]), linear(x, W[p + "in_proj_a.weight"])
        taps = W[p + "conv1d.weight"][:, 0, :]  # [C, K]; tap K-1 multiplies the current token
        padded = F.pad(mixed, (0, 0, K - 1, 0))
        mixed = F.silu(sum(taps[:, j] * padded[:, j:j + T] for j in range(K)))
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], -1)
        q = (l2norm(q.view(B, T, hk, dk)) * dk ** -0.5).repeat_interleave(r, 2)
        k = l2norm(k.view(B, T, hk, dk)).repeat_interleave(r, 2)
        v = v.view(B, T, hv, dv)
        beta = torch.sigmoid(b)
        g = -W[p + "A_log"].exp() * F.softplus(a + W[p + "dt_bias"])
        state = torch.zeros(B, hv, dk, dv, dtype=torch.float64)
        outs = []
        for t in range(T):
            state = state * g[:, t].exp()[..., None, None]
            delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
            state = state + k[:, t, :, :, None] * delta[:, :, None, :]
            outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
        o = torch.stack(outs, 1)
        z = z.reshape(B, T, hv, dv)
        y = W[p + "norm.weight"] * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z)
        return linear(y.reshape(B, T, -1), W[p + "out_proj.weight"])

    def gated_attention(x, p):
        qg = linear(x, W[p + "q_proj.weight"]).view(B, T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = linear(x, W[p + "k_proj.weight"]).view(B, T, nkv, hd)
        v = linear(x, W[p + "v_proj.weight"]).view(B, T, nkv, hd)
        q, k = rms_zero_centred(q, W[p + "q_norm.weight"]), rms_zero_centred(k, W[p + "k_norm.weight"])
        angle = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, rd, 2) / rd)
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]

        def rope(x):
            x1, x2, rest = x[..., :rd // 2], x[..., rd // 2:rd], x[..., rd:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)

        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // nkv, 2), v.repeat_interleave(nh // nkv, 2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) * hd ** -0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        att = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)
        return linear((att * torch.sigmoid(gate)).reshape(B, T, -1), W[p + "o_proj.weight"])

    def swiglu(x, gate, up, down):
        return linear(F.silu(linear(x, gate)) * linear(x, up), down)

    def moe(x, p):
        logits = linear(x, W[p + "gate.weight"])
        probs = logits.softmax(-1)
        weight, chosen = probs.topk(top_k, -1)
        if tc.get("norm_topk_prob", True):  # Qwen3.5 has no such field and always renormalises
            weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            w_e = ((chosen == e) * weight).sum(-1, keepdim=True)
            out = out + w_e * swiglu(x, *(W[f"{p}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down")))
        shared = swiglu(x, *(W[f"{p}shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down")))
        return out + torch.sigmoid(linear(x, W[p + "shared_expert_gate.weight"])) * shared, logits

    h = W[prefix + "embed_tokens.weight"][input_ids]
    router_logits = []
    for i, kind in enumerate(tc["layer_types"]):
        p = f"{prefix}layers.{i}."
        x = rms_zero_centred(h, W[p + "input_layernorm.weight"])
        h = h + (gated_delta_net(x, p + "linear_attn.") if kind == "linear_attention"
                 else gated_attention(x, p + "self_attn."))
        ffn, logits = moe(rms_zero_centred(h, W[p + "post_attention_layernorm.weight"]).view(B * T, H), p + "mlp.")
        h = h + ffn.view(B, T, H)
        router_logits.append(logits)
    logits = linear(rms_zero_centred(h, W[prefix + "norm.weight"]), W["lm_head.weight"])
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1))
    probs = torch.cat(router_logits).softmax(-1)
    f = F.one_hot(probs.topk(top_k, -1).indices, E).double().mean(0)  # [k, E], no gradient
    aux = E * (f * probs.mean(0)).sum()
    return logits, ce, aux, ce + tc["router_aux_loss_coef"] * aux


def check_against_spec(case_dir):
    """Fixture (transformers, fp32) against spec_reference (fp64): the error scale a C++ test must allow."""
    config = json.load(open(os.path.join(case_dir, "config.json")))
    weights = {k: v.double().requires_grad_() for k, v in read_safetensors(os.path.join(case_dir, "model.safetensors")).items()}
    debug = read_safetensors(os.path.join(case_dir, "debug.safetensors"))
    logits, ce, aux, loss = spec_reference(config, weights, debug["input_ids"].long())
    names = [k[len("grad."):] for k in debug if k.startswith("grad.")]
    grads = torch.autograd.grad(loss, [weights[n] for n in names])
    ref = debug["logits"].double()
    logit_rel = ((logits - ref).norm() / ref.norm()).item()
    grad_rel = max(((g - debug["grad." + n]).norm() / g.norm()).item() for n, g in zip(names, grads))
    loss_err = max(abs(a.item() - debug[k].item()) for a, k in ((ce, "ce_loss"), (aux, "aux_loss"), (loss, "loss")))
    assert logit_rel < 1e-5 and grad_rel < 1e-3 and loss_err < 1e-5, (logit_rel, grad_rel, loss_err)
    return logit_rel, (logits - ref).abs().max().item(), grad_rel, loss_err


def make_case(family, num_layers, base_seed, out_dir, extra_checks):
    input_ids = make_inputs(TINY_TEXT["vocab_size"])
    # Of a few seeds, the one whose expert choice is least ambiguous over the recorded step and every
    # training step: near-ties would make a correct implementation disagree with transformers.
    candidates = []
    for attempt in range(SEED_CANDIDATES):
        seed = base_seed + 100 * attempt
        losses, margin = train_trace(build_model(family, num_layers, seed), input_ids)
        candidates.append((margin, seed, losses))
    margin, seed, losses = max(candidates)
    assert margin >= MIN_ROUTING_MARGIN, f"{family}_L{num_layers}: best routing margin {margin:.1e}"
    model = build_model(family, num_layers, seed)
    model.train()  # no dropout anywhere (attention_dropout 0); train() only mirrors a training step

    out, ce = forward(model, input_ids)
    # The aux term moves the total router gradient by only ~1e-5 relative (coefficient 1e-3), below any
    # fp32 parity tolerance, so its own gradient w.r.t. each router weight is recorded separately.
    routers = {n: p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    aux_grads = dict(zip(routers, torch.autograd.grad(out.aux_loss, list(routers.values()), retain_graph=True)))
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            assert name.startswith("model.visual."), f"{name} got no gradient"
            continue
        grads[name] = p.grad.detach().clone()
    grads = checkpoint_names(model, grads)

    case_dir = os.path.join(out_dir, f"{family}_L{num_layers}")
    shutil.rmtree(case_dir, ignore_errors=True)
    model.save_pretrained(case_dir)
    os.remove(os.path.join(case_dir, "generation_config.json"))  # generation defaults: not needed here
    weights = read_safetensors(os.path.join(case_dir, "model.safetensors"))
    for name, g in list(grads.items()) + list(aux_grads.items()):
        assert name in weights and weights[name].shape == g.shape, name
    assert all(n in grads or n.startswith("model.visual.") for n in weights)

    # Reload as a user would and demand bit-identical logits; then re-save and demand identical tensors.
    reloaded = type(model).from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager",
                                           experts_implementation="eager")
    reloaded.train()
    with torch.no_grad():
        logits_again = reloaded(input_ids=input_ids).logits
    assert torch.equal(logits_again, out.logits.detach()), (logits_again - out.logits).abs().max()
    with tempfile.TemporaryDirectory() as tmp:
        reloaded.save_pretrained(tmp)
        resaved = read_safetensors(os.path.join(tmp, "model.safetensors"))
    assert resaved.keys() == weights.keys() and all(torch.equal(resaved[k], weights[k]) for k in weights)

    assert abs(losses[0].item() - out.loss.item()) < 1e-6 * abs(out.loss.item())

    debug = {
        "input_ids": input_ids.to(torch.int32),
        "logits": out.logits.detach().float().contiguous(),
        "loss": out.loss.detach().float().reshape(()),
        "ce_loss": ce.detach().float().reshape(()),
        "aux_loss": out.aux_loss.detach().float().reshape(()),
        "train_losses": losses,
    }
    debug.update({f"grad.{k}": v.float().contiguous() for k, v in grads.items()})
    debug.update({f"aux_grad.{k}": v.float().contiguous() for k, v in aux_grads.items()})
    tc = text_config_of(model)
    metadata = {
        "family": family,
        "num_hidden_layers": str(num_layers),
        "layer_types": json.dumps(tc.layer_types),
        "model_seed": str(seed),
        "min_routing_margin": f"{margin:.3e}",
        "routing_margin": ("smallest gap between the k-th and (k+1)-th router probability over all tokens, MoE "
                           "layers and training steps; the fp32 error of the probabilities is ~6e-6"),
        "input_seed": str(INPUT_SEED),
        "batch": str(BATCH),
        "seq": str(SEQ),
        "labels": "input_ids; transformers shifts: logits[:, t] predicts input_ids[:, t+1], last position ignored",
        "ce_loss": "mean cross-entropy over the B*(T-1) shifted positions, fp32",
        "loss": "ce_loss + router_aux_loss_coef * aux_loss",
        "aux_loss": "transformers load_balancing_loss_func over the router logits of every MoE layer",
        "router_aux_loss_coef": repr(tc.router_aux_loss_coef),
        "grad_names": "grad.<tensor name in model.safetensors>; model.visual.* has no gradient",
        "aux_grad": "aux_grad.<router weight name> = d(aux_loss)/dW, without the coefficient",
        "optimizer": "torch.optim.AdamW",
        "lr": repr(ADAMW["lr"]),
        "beta1": repr(ADAMW["betas"][0]),
        "beta2": repr(ADAMW["betas"][1]),
        "eps": repr(ADAMW["eps"]),
        "weight_decay": repr(ADAMW["weight_decay"]),
        "train_steps": str(TRAIN_STEPS),
        "train_trace": ("same batch every step; train_losses[k] = loss before step k; decoupled weight decay on "
                        "every parameter (norms, A_log, dt_bias included); no grad clipping; bias-corrected"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    debug_path = os.path.join(case_dir, "debug.safetensors")
    write_safetensors(debug_path, debug, metadata)
    back = read_safetensors(debug_path)
    assert back.keys() == debug.keys() and all(torch.equal(back[k], debug[k]) for k in debug)

    row = dict(case=f"{family}_L{num_layers}", seed=seed, margin=margin,
               params=sum(w.numel() for w in weights.values()),
               loss=out.loss.item(), ce=ce.item(), aux=out.aux_loss.item(), train=losses.tolist())
    row["spec"] = check_against_spec(case_dir)
    if extra_checks:
        model.eval()
        with torch.no_grad():
            eval_logits = model(input_ids=input_ids).logits
        assert torch.equal(eval_logits, out.logits.detach())  # train() and eval() run the same math
        row["chunk_vs_recurrent"] = chunk_vs_recurrent(family, model, input_ids)
        row["sensitivity"] = sensitivity(model, family, input_ids, eval_logits)
        row["aux_share_of_router_grad"] = aux_share_of_router_grad(model, input_ids)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/fixtures/parity")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # fixed reduction order: bit-reproducible files
    os.makedirs(args.out, exist_ok=True)

    rows = []
    for fi, family in enumerate(FAMILIES):
        for num_layers in LAYER_COUNTS:
            rows.append(make_case(family, num_layers, base_seed=1000 * (fi + 1) + num_layers, out_dir=args.out,
                                  extra_checks=num_layers == 5))

    print(f"{'case':<16}{'seed':>6}{'params':>9}{'loss':>12}{'ce':>12}{'aux':>12}{'margin':>10}   train_losses")
    for r in rows:
        train = ", ".join(f"{x:.6f}" for x in r["train"])
        print(f"{r['case']:<16}{r['seed']:>6}{r['params']:>9}{r['loss']:>12.6f}{r['ce']:>12.6f}{r['aux']:>12.6f}"
              f"{r['margin']:>10.1e}   [{train}]")
    print("\nfixture (transformers fp32) vs spec_reference (fp64): logits rel-rms / max abs, worst grad rel-rms, "
          "worst |loss| error")
    for r in rows:
        logit_rel, logit_abs, grad_rel, loss_err = r["spec"]
        print(f"{r['case']:<16}{logit_rel:>10.2e}{logit_abs:>10.2e}{grad_rel:>10.2e}{loss_err:>10.2e}")
    for r in rows:
        if "sensitivity" not in r:
            continue
        calls, core, logits = r["chunk_vs_recurrent"]
        print(f"\n{r['case']}: chunked vs recurrent delta rule ({calls} GDN calls): "
              f"max |diff|/max|out| {core:.2e}, max logit diff {logits:.2e}")
        print(f"{r['case']}: aux term's share of the router gradient: {r['aux_share_of_router_grad']:.3e}")
        for label, rel in r["sensitivity"].items():
            print(f"{r['case']}: slip '{label}': relative logit change {rel:.3f}")
            assert rel > 0.05, f"fixture blind to: {label}"


if __name__ == "__main__":
    main()
