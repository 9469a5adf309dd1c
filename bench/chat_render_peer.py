#!/usr/bin/env python3
"""transformers' side of bench/chat_bench.sh: the same cases rendered by render_jinja_template (after
_normalize_chat_messages, as apply_chat_template does), REPS passes after a warm-up, the best pass reported.
    chat_render_peer.py CASES.jsonl TEMPLATE_DIR REPS"""
import json
import os
import sys
import time

from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

cases_path, template_dir, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
cases = {}
for line in open(cases_path, encoding="utf-8"):
    c = json.loads(line)
    if "source" not in c and "rendered" in c:
        cases.setdefault(c["template"], []).append(c)
for name, items in sorted(cases.items()):
    source = open(os.path.join(template_dir, name), encoding="utf-8", newline="").read()
    best = float("inf")
    for r in range(reps + 1):
        t0 = time.perf_counter()
        size = 0
        for c in items:
            out, _ = render_jinja_template(conversations=[_normalize_chat_messages(c["messages"])], tools=c["tools"],
                                           chat_template=source, add_generation_prompt=c["add_generation_prompt"],
                                           **c["extra"])
            size += len(out[0].encode("utf-8"))
        if r > 0:
            best = min(best, time.perf_counter() - t0)
    print(json.dumps({"template": name, "conversations": len(items), "per_s": round(len(items) / best, 1),
                      "mb_per_s": round(size / best / 1e6, 2)}))
