#!/usr/bin/env python3
"""The client of bench/serve_bench.sh: measures an OpenAI-style server (hybridscan serve or llama-server).

  serve_bench.py throughput --url URL --concurrency C --requests R --prompt-len P --new N --vocab V [--seed S]
      C clients, each sending R streamed /v1/completions one after another (prompts of P random token ids, N new
      tokens, ignore_eos, greedy); prints {"concurrency", "requests", "generated_tokens", "seconds",
      "tokens_per_s"} where tokens are what the streams delivered (usage's completion_tokens) over the wall time of all.
  ttft --url URL --system-len L --vocab V [--seed S]
      A first request whose prompt is a system part of L random ids and a question, then a second with the same
      system part and another question: prints the time to the first streamed token of each and the prompt tokens
      the server reported as cached for the second.
"""
import argparse
import json
import random
import threading
import time
import urllib.request


def stream(url, prompt, new):
    """(completion tokens, seconds to the first text chunk, usage) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, usage, chunks = None, None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if j.get("usage"):
                usage = j["usage"]
            for c in j.get("choices") or []:
                if c.get("text") is not None and first is None:
                    first = time.perf_counter() - t0
                chunks += 1
    n = usage["completion_tokens"] if usage else chunks
    return n, first, usage


def cmd_throughput(a):
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(a.vocab) for _ in range(a.prompt_len)] for _ in range(a.concurrency * a.requests)]
    counts, errors = [], []

    def client(k):
        for i in range(a.requests):
            try:
                counts.append(stream(a.url, prompts[k * a.requests + i], a.new)[0])  # (list.append is atomic)
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(repr(e))

    stream(a.url, prompts[0][:8], 2)  # warm up
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = time.perf_counter() - t0
    print(json.dumps({"concurrency": a.concurrency, "requests": len(counts), "generated_tokens": sum(counts),
                      "seconds": s, "tokens_per_s": sum(counts) / s, "errors": errors[:3]}))


def cmd_ttft(a):
    rng = random.Random(a.seed)
    system = [rng.randrange(a.vocab) for _ in range(a.system_len)]
    out = {}
    for name, q in (("first", 11), ("second", 29)):
        question = [rng.randrange(a.vocab) for _ in range(q)]
        _, first, usage = stream(a.url, system + question, 1)
        out[name + "_ttft_s"] = first
        out[name + "_cached_tokens"] = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("throughput")
    for n, ty in (("--url", str), ("--concurrency", int), ("--requests", int), ("--prompt-len", int), ("--new", int),
                  ("--vocab", int)):
        t.add_argument(n, type=ty, required=True)
    t.add_argument("--seed", type=int, default=1)
    f = sub.add_parser("ttft")
    for n, ty in (("--url", str), ("--system-len", int), ("--vocab", int)):
        f.add_argument(n, type=ty, required=True)
    f.add_argument("--seed", type=int, default=2)
    a = p.parse_args()
    {"throughput": cmd_throughput, "ttft": cmd_ttft}[a.cmd](a)


if __name__ == "__main__":
    main()
