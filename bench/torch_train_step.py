#!/usr/bin/env python3
"""PyTorch peer (eager, or torch.compile) for hybridscan's training-step benchmark.

Builds the `small` preset (Qwen3-Next family) as Hugging Face `Qwen3NextForCausalLM`, random init, and times
full training steps on the CPU: forward with the router auxiliary loss, backward, global-norm clip, AdamW.
Prints one JSON line:
  {"impl": "torch-eager" | "torch-compile", "tokens_per_s": ..., "dtype": ..., "threads": ..., "batch": ..., "seq": ...,
   "step_seconds": [...], ...}

--dtype fp32: everything fp32.
--dtype bf16: fp32 master weights and optimizer, forward under torch.autocast(cpu, bfloat16) - the same split as
hybridscan's default (fp32 weights, bf16 compute), so both sides hold and update the same fp32 state.
--compile: the model's forward through torch.compile (inductor, the default mode); the first step compiles, so
--warmup must be >= 1 and compilation is never timed. The JSON also gives the compile time and the graph breaks
dynamo reported (count and reasons), since each break leaves an eager region between compiled graphs.
"""
import argparse
import json
import resource
import sys
import time
import warnings


def small_config(transformers):
    """The `small` preset of src/model/config.cpp, field for field."""
    layers = 8
    interval = 4  # full_attention_interval: layer i is full attention iff (i + 1) % 4 == 0
    return transformers.Qwen3NextConfig(
        vocab_size=256,
        hidden_size=256,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        router_aux_loss_coef=0.001,
        output_router_logits=True,
        tie_word_embeddings=False,
        use_cache=False,
    )


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="fp32, or bf16 = fp32 weights with bf16 autocast (default fp32)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--attn-impl", default=None,
                   help="transformers attn_implementation (default: transformers' choice, sdpa on CPU)")
    p.add_argument("--experts-impl", default=None,
                   help="transformers experts_implementation (default: transformers' choice, grouped_mm)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (inductor); needs --warmup >= 1 (the compile is not timed)")
    a = p.parse_args()
    if a.compile and a.warmup < 1:
        p.error("--compile needs --warmup >= 1 so that compilation is not timed")
    for name in ("threads", "batch", "seq", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    return a


def main():
    a = parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"torch_train_step.py: needs torch and transformers ({e}); pip install torch transformers")

    import_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = small_config(transformers)
    if a.attn_impl:
        cfg._attn_implementation = a.attn_impl
    if a.experts_impl:
        cfg._experts_implementation = a.experts_impl
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = transformers.Qwen3NextForCausalLM(cfg)
    model.train()
    if a.compile:
        # transformers installs its output-capturing hooks on the first forward, under a threading.Lock that dynamo
        # cannot enter: compiled as is, the first step breaks the graph there and the next recompiles once the hooks
        # exist. Installed up front, neither happens.
        try:
            from transformers.utils.output_capturing import maybe_install_capturing_hooks
            maybe_install_capturing_hooks(model)
        except ImportError:
            pass
    forward = torch.compile(model) if a.compile else model

    # Same optimizer work as hybridscan's default step: AdamW with decay on matrices/embeddings only, clip at 1.0.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(a.seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16")

    def step():
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=gen)
        t0 = time.perf_counter()
        with autocast:
            out = forward(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, out

    with warnings.catch_warnings(record=True) as caught_step:
        warnings.simplefilter("always")
        t_warm = time.perf_counter()
        for _ in range(a.warmup):
            step()
        warmup_seconds = time.perf_counter() - t_warm
        times, out = [], None
        for _ in range(a.steps):
            dt, out = step()
            times.append(dt)
    if out.aux_loss is None:
        sys.exit("torch_train_step.py: the model returned no aux_loss; output_router_logits did not take effect")

    tokens = a.batch * a.seq
    result = {
        "impl": "torch-compile" if a.compile else "torch-eager",
        "tokens_per_s": tokens * len(times) / sum(times),
        "dtype": a.dtype,
        "threads": a.threads,
        "batch": a.batch,
        "seq": a.seq,
        "step_seconds": [round(t, 4) for t in times],
        "best_step_tokens_per_s": tokens / min(times),  # the least disturbed step, for noisy shared machines
        "loss": out.loss.item(),
        "aux_loss": out.aux_loss.item(),
        "params": sum(p.numel() for p in model.parameters()),
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": model.config._experts_implementation,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "import_rss_bytes": import_rss,  # the torch + transformers libraries alone, before the model exists
        "warmup_seconds": round(warmup_seconds, 2),  # includes the compile with --compile
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if a.compile:
        from torch._dynamo.utils import counters
        breaks = counters["graph_break"]
        result["graph_breaks"] = sum(breaks.values())
        result["graph_break_reasons"] = {str(k)[:200]: v for k, v in breaks.items()}
        result["unique_graphs"] = counters["stats"]["unique_graphs"]
    for w in caught + caught_step:
        print(f"torch_train_step.py: warning: {w.category.__name__}: {w.message}", file=sys.stderr)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
