#!/usr/bin/env python3
"""`hybridscan serve` end to end with the real `openai` client (ctest runs each case as its own test).

  serve_test.py BINARY CASE

The model is the parity fixture qwen3_next_L5 (random weights, a vocabulary of 256 bytes: text is bytes, so any
token id is a prompt and the chat format is plain text). Answers carry their token ids (the server's `return_tokens`
extension), so they are compared with `hybridscan generate --json` id for id.

Cases:
  greedy   greedy answers equal generate's, streamed and not, chat and completions, with 1, 4 and 16 concurrent
           clients of different prompt lengths (1 to 300 tokens) and max_tokens
  batching a 12,000-token prompt is prefilled in --prefill-chunk pieces between decode steps: a stream already
           running gets a decode step per piece meanwhile (the scheduler's count), and the answer equals generate's
  seeded   a seeded sampled answer is reproducible and equals generate --seed's
  cache    a shared system prompt and a multi-turn conversation are prefilled only past the cached prefix (usage's
           cached_tokens and /metrics), with answers bit-identical to a server without a cache (logprobs compared)
  evict    a prefix cache of a few chunks evicts, stays within its budget, and answers stay those of a cold server
  errors   400 for malformed JSON, wrong types, an unknown model, max_tokens <= 0 or past the context, a prompt longer
           than the context; 401 without the API key; 413 over --max-body; 429 with Retry-After past slots + queue; a
           client that disconnects frees its slot; a client that stalls is dropped; the server keeps serving
  gguf     serve of a Q8_0 .gguf (from its quantized blocks, the default): greedy answers equal generate's on it,
           cold and restored from the prefix cache; plan --serve of the file is the planned peak /metrics reports,
           and bounds the accountant's peak plus the mapped blocks
  drain    SIGTERM: the running stream finishes (all its tokens, then [DONE]), new requests are refused, exit 0
  plan     plan --serve gives the peak /metrics reports as planned, and the accountant's peak stays within it
  page     the chat page at / in headless Chromium (Debian's chromium + chromium-driver, driven over WebDriver's HTTP
           protocol): a typed message streams an answer equal to the API's, with its tokens/s and cached tokens shown;
           SERVE_PAGE_SCREENSHOT=FILE saves a screenshot (skipped, exit 77, without chromedriver)
  speculative  serve --speculative mtp --draft 1..3 on a tiny+mtp checkpoint: greedy answers (and their logprobs)
           equal a plain server's, 8 concurrent clients on 4 slots, cold and restored from the prefix cache; a seeded
           sampled answer is reproducible (cold and cached); /metrics counts drafts and accepted ones; plan --serve
           --speculative gives the planned peak and bounds the accountant's; bad flags are refused with the fix
  load     SERVE_LOAD_CLIENTS (16) streaming clients for SERVE_LOAD_SECONDS (8): no failed request, every answer the
           expected tokens (none lost or repeated), resident memory flat (the issue's 64 x 60 s: set them)
"""
import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import openai

HERE = pathlib.Path(__file__).resolve().parent
CK = HERE / "fixtures" / "parity" / "qwen3_next_L5"
# The checkpoint has no chat template: chat requests render with this one (the format chat_ids() writes).
CHAT_TEMPLATE = HERE / "fixtures" / "serve" / "chat_template.jinja"
MODEL = CK.name
ENV = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
BINARY = None
SERVERS = []


def fail(msg):
    sys.exit(f"FAILED: {msg}")


def check(cond, msg):
    if not cond:
        fail(msg)


class Server:
    """A `hybridscan serve` on 127.0.0.1 and a free port; killed at the end whatever happens."""

    def __init__(self, *args, ckpt=CK, chat_template=CHAT_TEMPLATE):
        template = ["--chat-template", str(chat_template)] if chat_template else []
        self.proc = subprocess.Popen([BINARY, "serve", "--checkpoint", str(ckpt), "--port", "0", "--threads", "2",
                                      *template, *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        SERVERS.append(self)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on port "):
            self.proc.kill()
            fail(f"the server did not start: {line}{self.proc.stderr.read()}")
        self.port = int(line.split()[-1])
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key="none", **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def metrics(self):
        out = {}
        with urllib.request.urlopen(self.url + "/metrics") as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, v = line.rsplit(" ", 1)
                    out[k] = float(v)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def cleanup():
    for s in SERVERS:
        s.stop()


def post(url, body, headers=None, raw=None):
    """(status, headers, parsed JSON body or text) of a POST, errors included."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, dict(e.headers), json.loads(text)
        except json.JSONDecodeError:
            return e.code, dict(e.headers), text


def generate(prompts, max_new, *extra):
    """generate --json's token ids for each prompt (ids), prefilled in serve's 64-token pieces."""
    cmd = [BINARY, "generate", "--checkpoint", str(CK), "--max-new-tokens", str(max_new), "--json", "--threads", "2",
           "--prefill-piece", "64", *map(str, extra)]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=ENV, timeout=300)
    check(r.returncode == 0, f"{' '.join(cmd[:8])}...: {r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])["tokens"]


def prompt_ids(n, seed):
    return [(seed * 131 + i * 37 + (i * i) % 11) % 256 for i in range(n)]


def chat_ids(messages):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"
    return list(text.encode())


def ask(client, *, chat, stream, prompt=None, messages=None, **kw):
    """(token ids, finish reason, usage, logprobs list) of one request through the openai client."""
    extra = {"return_tokens": True}
    if "top_k" in kw:  # not an OpenAI parameter: the client sends it in the body's extras
        extra["top_k"] = kw.pop("top_k")
    if "ignore_eos" in kw:
        extra["ignore_eos"] = kw.pop("ignore_eos")
    if chat:
        r = client.chat.completions.create(model=MODEL, messages=messages, stream=stream, extra_body=extra, **kw)
    else:
        r = client.completions.create(model=MODEL, prompt=prompt, stream=stream, extra_body=extra, **kw)
    if not stream:
        c = r.choices[0]
        lp = None
        if kw.get("logprobs"):
            lp = [t.logprob for t in c.logprobs.content] if chat else c.logprobs.token_logprobs
        return c.model_extra["token_ids"], c.finish_reason, r.usage, lp
    ids, finish, usage, lp = [], None, None, []
    for ch in r:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            ids += (c.model_extra or {}).get("token_ids", [])
            if c.logprobs is not None:
                lp += [t.logprob for t in c.logprobs.content] if chat else c.logprobs.token_logprobs
            if c.finish_reason:
                finish = c.finish_reason
    return ids, finish, usage, lp


def run_concurrently(fns):
    out, errors = [None] * len(fns), []

    def go(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"request {i}: {e!r}")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(not errors, "; ".join(errors))
    return out


def case_greedy():
    s = Server("--parallel", 16, "--ctx", 512, "--cache-bytes", "4MiB", "--prefill-chunk", 128)
    c = s.client()
    lengths = [1, 5, 17, 63, 64, 65, 100, 130, 200, 300, 7, 44, 90, 129, 250, 33]
    prompts = [prompt_ids(n, i) for i, n in enumerate(lengths)]
    want = generate(prompts, 24)
    for clients in (1, 4, 16):
        fns = []
        for i in range(clients):
            p, mt, stream = prompts[i], 8 + (i * 5) % 17, i % 2 == 1
            fns.append(lambda p=p, mt=mt, stream=stream: (ask(c, chat=False, stream=stream, prompt=p, max_tokens=mt,
                                                              temperature=0), mt))
        for i, ((ids, finish, usage, _), mt) in enumerate(run_concurrently(fns)):
            check(ids == want[i][:mt], f"{clients} clients, prompt {i} ({lengths[i]} tokens): {ids} != generate's "
                                       f"{want[i][:mt]}")
            check(finish == "length" and usage.completion_tokens == mt and usage.prompt_tokens == lengths[i],
                  f"finish {finish}, usage {usage}")
    # Chat through the chat format, streamed and not.
    msgs = [[{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Question {i}?" * (i + 1)}]
            for i in range(4)]
    want = generate([chat_ids(m) for m in msgs], 12)
    got = run_concurrently([lambda m=m, st=(i % 2 == 0): ask(c, chat=True, stream=st, messages=m, max_tokens=12,
                                                              temperature=0) for i, m in enumerate(msgs)])
    for i, (ids, _, usage, _) in enumerate(got):
        check(ids == want[i], f"chat {i}: {ids} != {want[i]}")
        check(usage.prompt_tokens == len(chat_ids(msgs[i])), f"chat usage {usage}")
    # /tokenize and /detokenize.
    st, _, body = post(s.url + "/tokenize", {"messages": msgs[0]})
    check(st == 200 and body["tokens"] == chat_ids(msgs[0]), f"/tokenize: {st} {body}")
    st, _, body = post(s.url + "/detokenize", {"tokens": list(b"hello")})
    check(st == 200 and body["content"] == "hello", f"/detokenize: {st} {body}")
    models = c.models.list()
    check([m.id for m in models.data] == [MODEL], f"/v1/models: {models}")
    print("greedy: 1, 4 and 16 concurrent clients and chat equal generate's tokens")


def case_gguf():
    """serve on a Q8_0 .gguf file (from its quantized blocks, the default): greedy answers equal generate's on it (the
    same 64-token prefill pieces on the quantized blocks, then fused steps), with the prefix cache's hit changing
    nothing."""
    global MODEL
    f = HERE / "fixtures" / "gguf" / "qwen3_next_L5.q8_0.gguf"
    MODEL = f.name  # the served model's name: the file's
    s = Server("--parallel", 4, "--ctx", 256, "--cache-bytes", "4MiB", "--prefill-chunk", 64, ckpt=f)
    c = s.client()
    lengths = [5, 70, 130]
    prompts = [prompt_ids(n, i) for i, n in enumerate(lengths)]
    cmd = [BINARY, "generate", "--checkpoint", str(f), "--max-new-tokens", "12", "--json",
           "--threads", "2", "--prefill-piece", "64", "--ignore-eos"]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=ENV, timeout=300)
    check(r.returncode == 0, f"generate: {r.stderr}")
    want = json.loads(r.stdout.strip().splitlines()[-1])["tokens"]
    for rnd in range(2):  # the second round restores the cached prefixes
        got = run_concurrently([lambda p=p: ask(c, chat=False, stream=False, prompt=p, max_tokens=12, temperature=0,
                                                 ignore_eos=True) for p in prompts])
        for i, (ids, _, _, _) in enumerate(got):
            check(ids == want[i], f"round {rnd}, prompt {i} ({lengths[i]} tokens): {ids} != generate's {want[i]}")
    m = s.metrics()
    check(m["hybridscan_cache_hits_total"] >= 2, f"no prefix-cache hits in the second round: {m}")
    # plan --serve of the same file and options plans it from its blocks: the server reports that plan, and its
    # accountant's peak plus the quantized blocks it maps stays within it.
    r = subprocess.run([BINARY, "plan", "--serve", "--model", str(f), "--parallel", "4", "--ctx", "256",
                        "--cache-bytes", "4MiB", "--json"], capture_output=True, text=True, env=ENV)
    check(r.returncode == 0, r.stderr)
    plan = json.loads(r.stdout)
    check(plan["weights_run_as"] == "gguf blocks" and plan["quantized_weights_bytes"] > 0, f"plan --serve: {plan}")
    check(m["hybridscan_memory_planned_peak_bytes"] == plan["total_bytes"], f"planned {m} vs plan --serve {plan}")
    used = m["hybridscan_memory_accounted_peak_bytes"] + m["hybridscan_weights_mapped_bytes"]
    check(m["hybridscan_weights_mapped_bytes"] == plan["quantized_weights_bytes"], f"mapped {m} vs {plan}")
    check(0 < used <= plan["total_bytes"], f"accountant + mapped blocks {used} over plan {plan}")
    print(f"gguf: serve of a .gguf equals generate on it, cold and from the prefix cache; plan --serve {plan['total_bytes']} "
          f"bytes, the accountant's peak + the mapped blocks {int(used)}")


def case_batching():
    n = 12000
    s = Server("--parallel", 2, "--ctx", n + 16, "--prefill-chunk", 64, "--cache-bytes", 0)
    c = s.client()
    a = c.completions.create(model=MODEL, prompt="In the beginning", max_tokens=n, temperature=0, stream=True)
    it = iter(a)
    for _ in range(5):  # the stream is running
        next(it)
    long_prompt = prompt_ids(n, 5)
    m0 = s.metrics()
    ids = ask(c, chat=False, stream=False, prompt=long_prompt, max_tokens=3, temperature=0)[0]
    m1 = s.metrics()
    a.close()
    # The scheduler's own figures (what the client has read may lag): the long prompt's prefill time, and the longest
    # wait between two decode steps of the running stream. In pieces of 64 the wait is about one piece's prefill, a
    # 188th of the whole; prefilled in one pass (or a stalled stream) it would be all of it. A quarter leaves room for
    # a loaded machine's pauses.
    prefill = m1["hybridscan_prefill_seconds_total"] - m0["hybridscan_prefill_seconds_total"]
    gap = m1["hybridscan_decode_gap_max_seconds"]
    check(gap < 0.25 * prefill, f"the running stream waited {gap:.3f} s between two tokens during a {prefill:.2f} s "
                               f"prefill of {n} tokens (want under a quarter of it: the prompt in 64-token pieces)")
    check(ids == generate([long_prompt], 3)[0], "the long prompt's answer differs from generate's")
    print(f"batching: the running stream waited at most {gap * 1e3:.1f} ms between tokens while a {n}-token prompt "
          f"was prefilled ({prefill:.2f} s, {-(-n // 64)} pieces); its answer equals generate's")


def case_seeded():
    s = Server("--parallel", 4, "--ctx", 256)
    c = s.client()
    p = prompt_ids(40, 3)
    kw = dict(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=20)
    a, _, _, lp_a = ask(c, chat=False, stream=False, prompt=p, logprobs=1, **kw)
    b, _, _, lp_b = ask(c, chat=False, stream=True, prompt=p, logprobs=1, **kw)
    other = ask(c, chat=False, stream=False, prompt=p, **dict(kw, seed=99))[0]
    want = generate([p], 20, "--temperature", 0.9, "--top-k", 50, "--top-p", 0.95, "--seed", 1234)[0]
    check(a == b == want, f"seeded: {a} / {b} / generate {want}")
    # Each streamed chunk's logprob is its own token's, also where the stream ends with held-back bytes (a text-only
    # last piece: sampled bytes of this byte vocabulary are often the start of a UTF-8 character).
    check(lp_a == lp_b and len(lp_a) == 20, f"streamed logprobs {lp_b} != {lp_a}")
    check(other != a, "another seed gave the same 20 tokens")
    print("seeded: reproducible, streamed or not, and equal to generate --seed")


def case_cache():
    warm = Server("--parallel", 4, "--ctx", 1024, "--cache-bytes", "16MiB")
    cold = Server("--parallel", 4, "--ctx", 1024, "--cache-bytes", 0)
    cw, cc = warm.client(), cold.client()
    system = {"role": "system", "content": "You answer questions about the King James Bible. " * 6}
    kw = dict(max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)

    def both(messages, stream=False):
        a = ask(cw, chat=True, stream=stream, messages=messages, **kw)
        b = ask(cc, chat=True, stream=stream, messages=messages, **kw)
        check(a[0] == b[0] and a[3] == b[3], f"the cached server's answer differs from the cold one's: {a} vs {b}")
        check(b[2].prompt_tokens_details.cached_tokens == 0, "the cold server reported cached tokens")
        return a

    # A shared system prompt: the second question reuses the chunks both prompts share.
    q1 = [system, {"role": "user", "content": "Who built the ark?"}]
    q2 = [system, {"role": "user", "content": "Who was Moses?"}]
    _, _, u1, _ = both(q1)
    check(u1.prompt_tokens_details.cached_tokens == 0, f"first request: {u1}")
    p1, p2 = chat_ids(q1), chat_ids(q2)
    shared = next(i for i in range(len(p1)) if p1[i] != p2[i])
    m0 = warm.metrics()
    _, _, u2, _ = both(q2, stream=True)
    m1 = warm.metrics()
    want = shared // 64 * 64
    check(want >= 256, f"the test's system prompt shares only {shared} tokens")
    check(u2.prompt_tokens_details.cached_tokens == want, f"shared system prompt: cached {u2} != {want}")
    check(m1["hybridscan_prefill_tokens_total"] - m0["hybridscan_prefill_tokens_total"] == len(p2) - want,
          f"prefilled {m1['hybridscan_prefill_tokens_total'] - m0['hybridscan_prefill_tokens_total']} tokens, "
          f"want {len(p2) - want}")
    check(m1["hybridscan_cached_tokens_total"] - m0["hybridscan_cached_tokens_total"] == want, "metrics' cached tokens")
    check(m1["hybridscan_cache_hits_total"] == m0["hybridscan_cache_hits_total"] + 1, "metrics' cache hits")
    # A multi-turn conversation: each turn's prompt starts with the previous one's.
    conv = [system, {"role": "user", "content": "Tell me about Noah."}]
    for turn in range(3):
        ids, _, u, _ = both(conv)
        if turn > 0:
            check(u.prompt_tokens_details.cached_tokens == min(prev, u.prompt_tokens - 1) // 64 * 64,
                  f"turn {turn}: cached {u.prompt_tokens_details.cached_tokens}, previous prompt {prev} tokens")
        prev = u.prompt_tokens
        conv = conv + [{"role": "assistant", "content": bytes(ids).decode("latin-1")},
                       {"role": "user", "content": f"And then, part {turn}?"}]
    print(f"cache: a shared system prompt restored {want} of {len(p2)} tokens; multi-turn prefix restored; the same "
          f"bits as a cold server")


def case_evict():
    probe = Server("--parallel", 1, "--ctx", 512, "--cache-bytes", "64MiB")
    ask(probe.client(), chat=False, stream=False, prompt=prompt_ids(64, 0), max_tokens=1, temperature=0)
    m = probe.metrics()
    node = int(m["hybridscan_cache_bytes"] / m["hybridscan_cache_nodes"])
    probe.stop()
    budget = 5 * node
    s = Server("--parallel", 2, "--ctx", 512, "--cache-bytes", budget)
    cold = Server("--parallel", 2, "--ctx", 512, "--cache-bytes", 0)
    prompts = [prompt_ids(200, i) for i in range(4)] + [prompt_ids(200, 0)[:150] + prompt_ids(30, 9)]
    for rnd in range(2):
        for i, p in enumerate(prompts):
            a = ask(s.client(), chat=False, stream=False, prompt=p, max_tokens=6, temperature=0, logprobs=1)
            b = ask(cold.client(), chat=False, stream=False, prompt=p, max_tokens=6, temperature=0, logprobs=1)
            check(a[0] == b[0] and a[3] == b[3], f"round {rnd} prompt {i}: {a} != cold {b}")
            check(s.metrics()["hybridscan_cache_bytes"] <= budget, "the cache passed its budget")
    m = s.metrics()
    check(m["hybridscan_cache_evictions_total"] > 0, f"no eviction: {m}")
    print(f"evict: {int(m['hybridscan_cache_evictions_total'])} evictions within {budget} bytes, answers as cold")


def case_errors():
    s = Server("--parallel", 1, "--queue", 0, "--ctx", 8192, "--max-body", 65536, "--timeout", 2)
    c = s.client()
    url = s.url + "/v1/completions"
    bad = [
        (b"{not json", "malformed JSON"),
        (json.dumps({"prompt": "a", "max_tokens": "5"}).encode(), "max_tokens of the wrong type"),
        (json.dumps({"prompt": "a", "temperature": "hot"}).encode(), "temperature of the wrong type"),
        (json.dumps({"prompt": "a", "model": "gpt-4"}).encode(), "an unknown model"),
        (json.dumps({"prompt": "a", "max_tokens": 0}).encode(), "max_tokens 0"),
        (json.dumps({"prompt": "a", "max_tokens": -3}).encode(), "max_tokens < 0"),
        (json.dumps({"prompt": "a", "max_tokens": 8192}).encode(), "max_tokens past the context"),
        (json.dumps({"prompt": "a", "max_tokens": 2**63 - 1}).encode(), "max_tokens whose sum with the prompt wraps"),
        (json.dumps({"prompt": [1] * 8192}).encode(), "a prompt longer than the context"),
        (json.dumps({"prompt": [1, 2, 999]}).encode(), "a token outside the vocabulary"),
    ]
    for raw, what in bad:
        st, _, body = post(url, None, raw=raw)
        check(st == 400 and isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
              and body["error"]["message"], f"{what}: {st} {body}")
    try:
        c.completions.create(model="gpt-4", prompt="a", max_tokens=2)
        fail("an unknown model was served")
    except openai.BadRequestError as e:
        check("not served here" in str(e), str(e))
    # A checkpoint without a chat template (and no --chat-template): chat is refused with 400, completions still served.
    bare = Server("--parallel", 1, chat_template=None)
    st, _, body = post(bare.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    check(st == 400 and "chat template" in body["error"]["message"], f"chat without a template: {st} {body}")
    st, _, body = post(bare.url + "/v1/completions", {"prompt": "a", "max_tokens": 1})
    check(st == 200, f"completions without a chat template: {st} {body}")
    bare.stop()
    st, _, body = post(url, {"prompt": "a" * 70000})
    check(st == 413 and body["error"]["message"], f"a body over --max-body: {st} {body}")
    # Past the one slot and an empty queue: 429 with Retry-After; a client that leaves frees its slot.
    long = c.completions.create(model=MODEL, prompt="a", max_tokens=8000, temperature=0, stream=True)
    next(iter(long))
    st, headers, body = post(url, {"prompt": "b", "max_tokens": 2})
    check(st == 429 and "Retry-After" in headers, f"over slots + queue: {st} {headers} {body}")
    long.close()
    deadline = time.time() + 10
    while time.time() < deadline and s.metrics()["hybridscan_busy_slots"] > 0:
        time.sleep(0.1)
    check(s.metrics()["hybridscan_busy_slots"] == 0, "a disconnected client kept its slot")
    check(s.metrics()["hybridscan_decode_tokens_total"] < 7999, "the disconnected request ran to its end")
    # A request that is not streamed, from a client that leaves: the answer's leading spaces (one a second) find it
    # gone. A context of 32768 so that the request cannot end on its own first: this model decodes ~7000 tokens/s on
    # an idle machine, and the disconnect shows at the first or second space.
    far = Server("--parallel", 1, "--ctx", 32768)
    with socket.create_connection(("127.0.0.1", far.port)) as sock:
        body = json.dumps({"prompt": "a", "max_tokens": 32000, "temperature": 0}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(1.2)
    deadline = time.time() + 10
    while time.time() < deadline and far.metrics()["hybridscan_busy_slots"] > 0:
        time.sleep(0.1)
    check(far.metrics()["hybridscan_busy_slots"] == 0, "a disconnected client (not streamed) kept its slot")
    ran = far.metrics()["hybridscan_decode_tokens_total"]
    check(ran < 31999, f"the disconnected request (not streamed) ran on ({ran} tokens)")
    far.stop()
    # A client that sends half a request and stalls is dropped after --timeout.
    t0 = time.time()
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
        sock.settimeout(15)
        try:
            rest = sock.recv(4096)
        except (ConnectionResetError, socket.timeout):
            rest = b""
    check(time.time() - t0 < 10, f"a stalled client held its connection {time.time() - t0:.1f} s")
    del rest
    # The server still answers, and an API key is asked for when set.
    check(ask(c, chat=False, stream=False, prompt="a", max_tokens=2, temperature=0)[1] == "length", "after the faults")
    keyed = Server("--api-key", "sesame", "--ctx", 64)
    for key in ("wrong", None):
        st, _, body = post(keyed.url + "/v1/completions", {"prompt": "a", "max_tokens": 1},
                           headers={"Authorization": f"Bearer {key}"} if key else {})
        check(st == 401 and body["error"]["code"] == "invalid_api_key", f"key {key}: {st} {body}")
    try:
        keyed.client(key="wrong").completions.create(model=MODEL, prompt="a", max_tokens=1)
        fail("a wrong key was accepted")
    except openai.AuthenticationError:
        pass
    check(ask(keyed.client(key="sesame"), chat=False, stream=False, prompt="a", max_tokens=1)[1] == "length", "keyed")
    with urllib.request.urlopen(keyed.url + "/health") as r:
        check(r.status == 200, "/health asks no key")
    m = s.metrics()
    check(m['hybridscan_requests_total{status="400"}'] >= len(bad)
          and m['hybridscan_requests_total{status="429"}'] >= 1,
          f"requests by status: {m}")
    print("errors: 400s, 401, 413, 429 with Retry-After, a disconnect frees its slot, a stalled client is dropped")


def case_trickle():
    # Clients that send their request one byte at a time, each byte inside --timeout (so no single read times out),
    # more of them than the pool has connection threads (--parallel + --queue + 16): each is dropped --request-timeout
    # after a thread takes it, so those queued behind wait at most a turn per pool's worth, and a request arriving
    # meanwhile is answered after at most all of them. Without the deadline the tricklers hold every thread for as long
    # as they trickle (here 30 s. Checked with the deadline disabled and 20 s of trickling: /health waited 19 s and the checks below failed).
    limit, count, trickle_for, pool = 3, 40, 30.0, 1 + 0 + 16
    rounds = -(-count // pool)  # the tricklers take the pool's threads in turns of `limit` seconds
    s = Server("--parallel", 1, "--queue", 0, "--ctx", 64, "--timeout", 2, "--request-timeout", limit)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
    held = [None] * count

    def trickle(i):
        t0 = time.time()
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.settimeout(0.5)
            for k in range(10 ** 6):
                if time.time() - t0 > trickle_for:
                    break
                try:
                    sock.sendall(head[k % len(head):k % len(head) + 1])
                    if sock.recv(1) == b"":  # the server closed it (an answer would be bytes: none is expected)
                        break
                except socket.timeout:
                    continue  # nothing from the server yet: the next byte
                except (BrokenPipeError, ConnectionResetError):
                    break
        held[i] = time.time() - t0

    threads = [threading.Thread(target=trickle, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0 = time.time()
    with urllib.request.urlopen(s.url + "/health", timeout=trickle_for + 10) as r:
        check(r.status == 200, f"/health: {r.status}")
    waited = time.time() - t0
    for t in threads:
        t.join()
    check(waited < rounds * limit + 4, f"/health waited {waited:.1f} s behind {count} trickling clients (limit {limit} s)")
    check(max(held) < rounds * limit + 3, f"a trickling client held its connection {max(held):.1f} s (limit {limit} s)")
    dropped = s.metrics()["hybridscan_connections_timed_out_total"]
    check(dropped >= count, f"{dropped} connections timed out, expected {count}")
    # A kept-alive connection's later request gets its own deadline: two requests on one connection, 2 s apart
    # (within the limit each), both answered.
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    for k in range(2):
        conn.request("GET", "/health")
        r = conn.getresponse()
        check(r.status == 200 and r.read() == b'{"status":"ok"}', f"kept-alive request {k}: {r.status}")
        time.sleep(2)
    conn.close()
    print(f"trickle: {count} trickling clients dropped after {min(held):.1f}-{max(held):.1f} s (limit {limit} s); "
          f"/health answered in {waited:.1f} s")


def case_drain():
    s = Server("--parallel", 2, "--ctx", 8192)
    c = s.client()
    stream = c.completions.create(model=MODEL, prompt="In the beginning", max_tokens=4000, temperature=0,
                                  stream=True, extra_body={"return_tokens": True})
    it = iter(stream)
    ids = list(next(it).choices[0].model_extra.get("token_ids", []))
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    st, _, body = post(s.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
    check(st == 503, f"a request while draining: {st} {body}")
    finish = None
    for ch in it:
        for ch_c in ch.choices:
            ids += (ch_c.model_extra or {}).get("token_ids", [])
            finish = ch_c.finish_reason or finish
    check(len(ids) == 4000 and finish == "length", f"the running stream was cut: {len(ids)} tokens, {finish}")
    check(s.proc.wait(timeout=30) == 0, f"exit status {s.proc.returncode}")
    check(ids == generate([list(b"In the beginning")], 4000)[0], "the drained stream's tokens")
    print("drain: SIGTERM finished the running stream (4000 tokens), refused new requests with 503, exited 0")


def case_plan():
    args = ["--parallel", 3, "--ctx", 512, "--cache-bytes", "2MiB"]
    r = subprocess.run([BINARY, "plan", "--serve", "--model", str(CK), "--weight-dtype", "fp32", "--json",
                        *map(str, args)], capture_output=True, text=True, env=ENV)
    check(r.returncode == 0, r.stderr)
    plan = json.loads(r.stdout)
    s = Server(*args)
    c = s.client()
    run_concurrently([lambda i=i: ask(c, chat=False, stream=True, prompt=prompt_ids(100 + 60 * i, i), max_tokens=20,
                                      temperature=0) for i in range(6)])
    m = s.metrics()
    check(m["hybridscan_memory_planned_peak_bytes"] == plan["total_bytes"], f"planned {m} vs plan --serve {plan}")
    check(0 < m["hybridscan_memory_accounted_peak_bytes"] <= plan["total_bytes"], f"accountant {m} over plan {plan}")
    print(f"plan: plan --serve {plan['total_bytes']} bytes; the server's accountant peaked at "
          f"{int(m['hybridscan_memory_accounted_peak_bytes'])}, resident {int(m['hybridscan_resident_bytes'])}")


def spec_checkpoint(tmp):
    """A tiny+mtp checkpoint (trained one step: random weights) whose MTP layer is a fair draft model: fc = [I | 0], so
    it drafts about head(norm(embed(x_{t+1}))) (its own random layer, scaled by 3, moves that by what it attends to:
    its keys and values matter); the decoder layers' matrices scaled by 0.7, so the model's next token is often, not
    always, that (60-80% of the drafts are kept at depth 1)."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file
    out = pathlib.Path(tmp) / "run"
    r = subprocess.run([BINARY, "train", "--preset", "tiny+mtp", "--synthetic", "--steps", "1", "--batch", "2",
                        "--seq", "16", "--threads", "1", "--out", str(out)], capture_output=True, text=True, env=ENV,
                       timeout=120)
    check(r.returncode == 0, f"train: {r.stderr}")
    ck = out / "checkpoint-1"
    f = ck / "model.safetensors"
    with safe_open(str(f), "np") as st:
        meta = st.metadata()
        t = {k: st.get_tensor(k) for k in st.keys()}
    hid = t["mtp.fc.weight"].shape[0]
    t["mtp.fc.weight"] = np.concatenate([np.eye(hid), np.zeros((hid, hid))], axis=1).astype(np.float32)
    for k, v in t.items():
        if k.startswith("mtp.layers.") and v.ndim >= 3:
            t[k] = (v * 3).astype(np.float32)
        elif (k.startswith("local.") or k.startswith("global.")) and v.ndim >= 3:
            t[k] = (v * 0.7).astype(np.float32)
    save_file(t, str(f), metadata=meta)
    return ck


def case_speculative():
    with tempfile.TemporaryDirectory() as tmp:
        speculative(spec_checkpoint(tmp))


def speculative(ck):
    global MODEL
    MODEL = ck.name
    common = ["--parallel", 4, "--ctx", 256]
    plain = Server(*common, "--cache-bytes", 0, ckpt=ck, chat_template=None)
    lengths = [1, 5, 17, 63, 64, 65, 100, 130]
    prompts = [prompt_ids(n, i) for i, n in enumerate(lengths)]
    kw = dict(temperature=0, logprobs=1, ignore_eos=True)
    maxes = [8 + (i * 5) % 17 for i in range(len(prompts))]
    want = [ask(plain.client(), chat=False, stream=False, prompt=p, max_tokens=mt, **kw)
            for p, mt in zip(prompts, maxes)]
    # End ids and stop strings met inside a run of kept drafts: the tokens past them are dropped. The end id (the
    # commonest answer token) is set in the config now: the plain server above started without it.
    flat = [t for w in want for t in w[0][2:]]
    eos = max(set(flat), key=flat.count)
    printable = [t for t in flat if 32 < t < 127 and t != eos]
    stop = chr(max(set(printable), key=printable.count))
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=eos)))
    want_eos = [(w[0][:w[0].index(eos) + 1], "stop") if eos in w[0] else (w[0], "length") for w in want]
    check(sum(f == "stop" for _, f in want_eos) >= 2, f"the end id {eos} ends only {want_eos}")
    want_stop = [ask(plain.client(), chat=False, stream=False, prompt=p, max_tokens=mt, temperature=0, stop=[stop],
                     ignore_eos=True) for p, mt in zip(prompts, maxes)]
    # A seeded sampled answer from a prompt past a chunk edge (the second time restored from the prefix cache).
    sampled = dict(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=30, ignore_eos=True)
    sp = prompt_ids(90, 7)
    for draft in (1, 2, 3):
        plan = subprocess.run([BINARY, "plan", "--serve", "--model", str(ck), "--weight-dtype", "fp32", "--json",
                               "--speculative", "mtp", "--draft", str(draft), "--cache-bytes", "4MiB",
                               *map(str, common)], capture_output=True, text=True, env=ENV)
        check(plan.returncode == 0, plan.stderr)
        plan = json.loads(plan.stdout)
        s = Server(*common, "--cache-bytes", "4MiB", "--speculative", "mtp", "--draft", draft, ckpt=ck,
                   chat_template=None)
        c = s.client()
        counts = []  # per round: verifications and drafts kept per position
        for rnd in range(2):  # the second round restores the prompts' cached chunks (the MTP layer's part too)
            m0 = s.metrics()
            got = run_concurrently([lambda p=p, mt=mt, i=i: ask(c, chat=False, stream=i % 2 == 1, prompt=p,
                                                                max_tokens=mt, **kw)
                                    for i, (p, mt) in enumerate(zip(prompts, maxes))])
            for i, (g, w) in enumerate(zip(got, want)):
                check(g[0] == w[0], f"draft {draft}, round {rnd}, prompt {i} ({lengths[i]} tokens): {g[0]} != the "
                                    f"plain server's {w[0]}")
                check(g[3] == w[3], f"draft {draft}, round {rnd}, prompt {i}: logprobs {g[3]} != plain {w[3]}")
                check(g[1] == "length" and g[2].completion_tokens == maxes[i], f"finish {g[1]}, usage {g[2]}")
            m1 = s.metrics()
            counts.append([m1[k] - m0[k] for k in m1 if k.startswith("hybridscan_spec_accepted_total")
                           or k == "hybridscan_spec_verifications_total"])
        got = run_concurrently([lambda p=p, mt=mt, i=i: ask(c, chat=False, stream=i % 2 == 0, prompt=p, max_tokens=mt,
                                                            temperature=0) for i, (p, mt) in enumerate(zip(prompts, maxes))])
        for i, (g, w) in enumerate(zip(got, want_eos)):
            check((g[0], g[1]) == w, f"draft {draft}, prompt {i}, end id {eos}: {g[:2]} != {w}")
        got = run_concurrently([lambda p=p, mt=mt, i=i: ask(c, chat=False, stream=i % 2 == 0, prompt=p, max_tokens=mt,
                                                            temperature=0, stop=[stop], ignore_eos=True)
                                for i, (p, mt) in enumerate(zip(prompts, maxes))])
        for i, (g, w) in enumerate(zip(got, want_stop)):
            check(g[:2] == w[:2], f"draft {draft}, prompt {i}, stop {stop!r}: {g[:2]} != the plain server's {w[:2]}")
        # A restored prefix gives the MTP layer the bits a cold prefill gives it (its keys and values, the hidden row it
        # waits on), so every request drafts, and keeps, exactly what it did in the first round.
        check(counts[0] == counts[1], f"draft {draft}: verifications and kept drafts cold {counts[0]} != cached "
                                      f"{counts[1]}")
        a = ask(c, chat=False, stream=False, prompt=sp, **sampled)[0]
        ask(c, chat=False, stream=False, prompt=prompt_ids(90, 8), **sampled)  # (the slot's rows are another's now)
        b, _, usage, _ = ask(c, chat=False, stream=True, prompt=sp, **sampled)
        check(usage.prompt_tokens_details.cached_tokens == 64, f"draft {draft}: the seeded prompt's chunk was not "
                                                               f"restored: {usage}")
        other = ask(c, chat=False, stream=False, prompt=sp, **dict(sampled, seed=99))[0]
        check(a == b and len(a) == 30, f"draft {draft}: a seeded sampled answer changed: {a} / {b}")
        check(other != a, f"draft {draft}: another seed gave the same 30 tokens")
        m = s.metrics()
        drafted, steps = m["hybridscan_spec_drafted_total"], m["hybridscan_spec_verifications_total"]
        acc = [m[f'hybridscan_spec_accepted_total{{position="{k}"}}'] for k in range(1, draft + 1)]
        check(drafted == draft * steps > 0, f"draft {draft}: {drafted} drafted in {steps} verifications")
        check(0 < acc[0] < steps and all(x >= y for x, y in zip(acc, acc[1:])),
              f"draft {draft}: accepted per position {acc} of {steps} (want some, not all, and fewer deeper)")
        check(m["hybridscan_cache_hits_total"] >= 4, f"draft {draft}: no prefix-cache hits: {m}")
        check(m["hybridscan_memory_planned_peak_bytes"] == plan["total_bytes"], f"planned {m} vs plan --serve {plan}")
        check(0 < m["hybridscan_memory_accounted_peak_bytes"] <= plan["total_bytes"],
              f"draft {draft}: the accountant's peak {m['hybridscan_memory_accounted_peak_bytes']} is over the plan "
              f"{plan['total_bytes']}")
        print(f"speculative: draft {draft}: answers equal the plain server's; drafts kept per position "
              f"{[round(x / steps, 2) for x in acc]} of {int(steps)} verifications; peak "
              f"{int(m['hybridscan_memory_accounted_peak_bytes'])} of {plan['total_bytes']} planned")
        s.stop()
    for args, msg in [(["--speculative", "mtp", "--draft", 0], "--draft must be in [1, 3] (got 0)"),
                      (["--speculative", "mtp", "--draft", 4], "--draft must be in [1, 3] (got 4)"),
                      (["--speculative", "eagle"], "--speculative 'eagle' is not known"),
                      (["--draft", 2], "--draft needs --speculative mtp")]:
        r = subprocess.run([BINARY, "serve", "--checkpoint", str(ck), "--port", "0", *map(str, args)],
                           capture_output=True, text=True, env=ENV, timeout=60)
        check(r.returncode != 0 and msg in r.stderr, f"serve {args}: exit {r.returncode}, {r.stderr}")
    r = subprocess.run([BINARY, "serve", "--checkpoint", str(CK), "--port", "0", "--speculative", "mtp"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    check(r.returncode != 0 and "has no multi-token-prediction layer" in r.stderr,
          f"serve --speculative mtp without an MTP layer: exit {r.returncode}, {r.stderr}")
    print("speculative: bad flags refused")


def case_load():
    clients = int(os.environ.get("SERVE_LOAD_CLIENTS", "16"))
    seconds = float(os.environ.get("SERVE_LOAD_SECONDS", "8"))
    s = Server("--parallel", 16, "--queue", max(64, clients), "--ctx", 512, "--cache-bytes", "8MiB")
    c = s.client()
    prompts = [prompt_ids(10 + 37 * i, i) for i in range(8)]
    want = generate(prompts, 16)
    done, errors, rss = [0], [], []
    stop_at = time.time() + seconds

    def client(k):
        i = k
        while time.time() < stop_at:
            p = i % len(prompts)
            try:
                ids, finish, _, _ = ask(c, chat=False, stream=True, prompt=prompts[p], max_tokens=16, temperature=0)
                if ids != want[p] or finish != "length":
                    errors.append(f"client {k}: prompt {p}: {ids} != {want[p]}")
                done[0] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(f"client {k}: {e!r}")
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    while time.time() < stop_at:
        time.sleep(seconds / 8)
        rss.append(s.metrics()["hybridscan_resident_bytes"])
    for t in threads:
        t.join()
    check(not errors, f"{len(errors)} failed: {errors[:3]}")
    mid, end = rss[len(rss) // 2], rss[-1]
    check(end <= mid * 1.10 + 16e6, f"resident memory grew: {[int(x) for x in rss]}")
    m = s.metrics()
    print(f"load: {clients} streaming clients x {seconds:.0f} s: {done[0]} requests, none failed, every answer exact; "
          f"resident {int(mid)} -> {int(end)} bytes; decode {m['hybridscan_decode_tokens_per_second']:.0f} tokens/s")


def case_page():
    import base64
    import shutil
    driver = shutil.which("chromedriver")
    if not driver or not shutil.which("chromium"):
        print("SKIPPED: chromium and chromium-driver are not installed (scripts/setup.sh installs them)")
        sys.exit(77)
    s = Server("--parallel", 2, "--ctx", 1024, "--cache-bytes", "4MiB")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dport = probe.getsockname()[1]
    drv = subprocess.Popen([driver, f"--port={dport}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{dport}"
        for _ in range(100):
            try:
                urllib.request.urlopen(base + "/status", timeout=1)
                break
            except OSError:
                time.sleep(0.1)

        def wd(method, path, body=None):
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(base + path, method=method, data=data,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())["value"]

        caps = {"capabilities": {"alwaysMatch": {"goog:chromeOptions": {
            "binary": shutil.which("chromium"),
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1000,700"]}}}}
        sid = wd("POST", "/session", caps)["sessionId"]
        try:
            wd("POST", f"/session/{sid}/url", {"url": s.url + "/"})

            def js(script):
                return wd("POST", f"/session/{sid}/execute/sync", {"script": script, "args": []})

            def element(css):
                found = wd("POST", f"/session/{sid}/element", {"using": "css selector", "value": css})
                return next(iter(found.values()))

            wd("POST", f"/session/{sid}/element/{element('#max')}/clear", {})
            wd("POST", f"/session/{sid}/element/{element('#max')}/value", {"text": "24"})
            answers = []
            for turn, text in enumerate(["In the beginning God created", "And the earth was without form"]):
                wd("POST", f"/session/{sid}/element/{element('#input')}/value", {"text": text})
                wd("POST", f"/session/{sid}/element/{element('#send')}/click", {})
                deadline = time.time() + 60
                while time.time() < deadline and not js(f"return !!document.getElementById('stats-{2 * turn + 2}')"):
                    time.sleep(0.2)
                stats = js(f"const e = document.getElementById('stats-{2 * turn + 2}'); return e ? e.textContent : ''")
                check("tokens/s" in stats and "24 tokens" in stats, f"turn {turn}: the page shows '{stats}'")
                answers.append(js(f"return document.querySelectorAll('.assistant')[{turn}].textContent"))
                if turn == 1:
                    check(" 0 from the cache" not in stats, f"the second turn restored nothing from the cache: {stats}")
            # The same conversation through the API gives the page's text.
            msgs = [{"role": "user", "content": "In the beginning God created"}]
            r = s.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
            api = r.choices[0].message.content
            check(api == answers[0], f"page {answers[0]!r} != API {api!r}")
            shot = os.environ.get("SERVE_PAGE_SCREENSHOT")
            if shot:
                pathlib.Path(shot).write_bytes(base64.b64decode(wd("GET", f"/session/{sid}/screenshot")))
        finally:
            wd("DELETE", f"/session/{sid}")
    finally:
        drv.kill()
        drv.wait()
    print(f"page: two turns typed in headless Chromium streamed answers equal to the API's; stats: {stats}")


CASES = {n[5:]: f for n, f in globals().items() if n.startswith("case_")}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in CASES:
        sys.exit(__doc__)
    BINARY = sys.argv[1]
    try:
        CASES[sys.argv[2]]()
    finally:
        cleanup()
