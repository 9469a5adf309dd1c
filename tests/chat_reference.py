#!/usr/bin/env python3
"""The Python side of tests/chat_template_test.cpp: generated conversations rendered by transformers'
apply_chat_template machinery, and their ids and loss masks computed independently of hybridscan.

    chat_reference.py TEMPLATE_DIR TOKENIZER_DIR OUT_FILE [CASES_PER_TEMPLATE]

For every TEMPLATE_DIR/Qwen*.jinja, CASES_PER_TEMPLATE (default 300) seeded conversations: multi-turn, with and
without system prompts, tool schemas, tool calls (arguments as objects or strings) and tool results, reasoning
(reasoning_content, or <think> inside the content), empty, whitespace-only and Unicode content, content as a list of
parts, add_generation_prompt both ways, enable_thinking absent, true or false. OUT_FILE gets one JSON line per case:
  {"template", "messages", "tools", "add_generation_prompt", "extra", "rendered" | "error",
   "ids", "mask"}   (ids and mask only for rendered cases without a generation prompt)
"rendered" is what transformers.utils.chat_template_utils.render_jinja_template gives after
_normalize_chat_messages (exactly what PreTrainedTokenizerBase.apply_chat_template(tokenize=False) does, less the
special-token variables, which no Qwen template reads). "error" is the exception's text when it raises.
The ids are Hugging Face `tokenizers`' encode(rendered, add_special_tokens=False) with TOKENIZER_DIR's qwen3_5 vocabulary
for Qwen3.5 templates and qwen2's for the others; mask[i] is 1 when token i's character offsets overlap an assistant
span: from after "<|im_start|>assistant\\n" through the end of the next "<|im_end|>" (to the end of the text when
there is none), found by a regular expression on the rendered text (docs/chat.md).
"""
import json
import os
import random
import re
import sys

import tokenizers
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

UNICODE = ["héllo wörld", "日本語のテキスト", "emoji 🎉👍🏽", "עברית ועוד", "مرحبا بالعالم", "ﬁ ligature", "e\u0301 combining",
           "Ελληνικά", "\u00a0nbsp edges\u00a0", "\u3000ideographic space\u3000", "tab\tand\nnewline", "zero\u200bwidth",
           "line\u2028separator", "한국어", "👨‍👩‍👧 family", "ascii only"]
EDGES = ["", " ", "\n", "\n\n", "  padded  ", "\nleading newline", "trailing newline\n", "'quotes' and \"doubles\"",
         "back\\slash", "<tool_response>inside</tool_response>", "a </think> inside", "{\"json\": [1, 2]}", "{{ not jinja }}",
         "{% raw %}", "50% off"]


def text(rng, allow_empty=True):
    k = rng.random()
    if allow_empty and k < 0.12:
        return rng.choice(EDGES)
    words = [rng.choice(UNICODE) if rng.random() < 0.3 else rng.choice(["the", "model", "answer", "is", "42", "why", "?",
                                                                        "Sure.", "def f(x):", "return x", "\n", "-"])
             for _ in range(rng.randint(1, 12))]
    return " ".join(words)


def scalar(rng):
    return rng.choice([rng.randint(-5, 1000), rng.choice([0.5, 1.0, 1e-05, 1e16, 3.14159, -2.5, 0.1, 1e100]),
                       True, False, None, text(rng), ""])


def arg_value(rng, depth=0):
    k = rng.random()
    if depth < 2 and k < 0.15:
        return [arg_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2 and k < 0.3:
        return {rng.choice(["a", "b", "zeta", "Alpha", "ключ"]) + str(i): arg_value(rng, depth + 1)
                for i in range(rng.randint(0, 3))}
    return scalar(rng)


def tool_schema(rng, i):
    props = {}
    for j in range(rng.randint(0, 3)):
        p = {"type": rng.choice(["string", "integer", "number", "boolean", "array"])}
        if rng.random() < 0.7:
            p["description"] = text(rng)
        if rng.random() < 0.3:
            p["enum"] = ["a", "b", "ç"]
        if rng.random() < 0.2:
            p["default"] = scalar(rng)
        props[rng.choice(["zcity", "amount", "unit", "query", "名前"]) + str(j)] = p
    params = {"type": "object", "properties": props}
    if props and rng.random() < 0.5:
        params["required"] = list(props)[:1]
    fn = {"name": "tool_%d" % i, "description": text(rng), "parameters": params}
    if rng.random() < 0.2:
        fn["strict"] = True
    if rng.random() < 0.15:
        del fn["description"]
    return {"type": "function", "function": fn} if rng.random() < 0.85 else fn


def tool_call(rng, tools, string_args):
    name = rng.choice([t.get("function", t)["name"] for t in tools]) if tools else "tool_x"
    args = {rng.choice(["zcity", "amount", "unit", "query", "名前"]) + str(j): arg_value(rng) for j in range(rng.randint(0, 3))}
    if string_args:
        args = json.dumps(args, ensure_ascii=rng.random() < 0.5)
    fn = {"name": name, "arguments": args}
    if rng.random() < 0.9:
        return {"id": "call_%d" % rng.randint(0, 99), "type": "function", "function": fn}
    return fn


def content(rng, parts_ok):
    if parts_ok and rng.random() < 0.15:
        return [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 3))]
    return text(rng)


def assistant(rng, tools, template):
    m = {"role": "assistant"}
    k = rng.random()
    if k < 0.25:
        m["reasoning_content"] = text(rng)
        m["content"] = text(rng)
    elif k < 0.4:
        m["content"] = "<think>\n" + text(rng) + "\n</think>\n\n" + text(rng)
    else:
        m["content"] = content(rng, template.startswith("Qwen3.5"))
    if rng.random() < 0.05:
        m["reasoning"] = text(rng)  # an older name transformers aliases to reasoning_content
    return m


def conversation(rng, template):
    # The XML-style templates (Qwen3-Coder, Qwen3.5) raise on arguments given as a JSON string: rarely, there.
    string_args = 0.03 if template.startswith(("Qwen3-Coder", "Qwen3.5")) else 0.4
    tools = [tool_schema(rng, i) for i in range(rng.randint(1, 3))] if rng.random() < 0.35 else None
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": content(rng, False)})
    for _ in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": content(rng, template.startswith("Qwen3.5"))})
        if rng.random() < 0.35:  # a tool-calling assistant turn, its results, then the answer
            call = {"role": "assistant", "content": text(rng) if rng.random() < 0.8 else "",
                    "tool_calls": [tool_call(rng, tools, rng.random() < string_args) for _ in range(rng.randint(1, 3))]}
            if rng.random() < 0.1:
                call["content"] = None  # dropped by transformers' normalisation
            if rng.random() < 0.3:
                call["reasoning_content"] = text(rng)
            msgs.append(call)
            for _ in range(rng.randint(1, 3)):
                msgs.append({"role": "tool", "content": text(rng), "tool_call_id": "call_1"})
        msgs.append(assistant(rng, tools, template))
    if rng.random() < 0.3:
        msgs.append({"role": "user", "content": text(rng)})
    if rng.random() < 0.1:  # keys in another order than the usual one
        msgs = [dict(reversed(list(m.items()))) for m in msgs]
    return msgs, tools


# Small templates for the semantics the real ones touch only in part: whitespace control (trim_blocks, lstrip_blocks,
# "-" and "+"), scoping, loops, filters, tests, operators, Python's str() and json.dumps. Rendered with
# SNIPPET_VARS and add_generation_prompt=False; each becomes a case whose "template" is "snippet:N" and whose
# "source" is the text.
SNIPPET_VARS = {"enable_thinking": False, "x": 3, "f": 2.5, "s": "  Hé llo\n", "d": {"b": 1, "a": [1, 2.0, None, True]},
                "l": ["x", "y", "z"], "big": 1e16, "small": 1e-05, "uni": "日本\u2028語"}
SNIPPETS = [
    "a\n  {% if true %}\n  b\n  {% endif %}\n  c\n",
    "{% for i in l %}\n    {{ i }}\n{% endfor %}\nend",
    "  {%- if true %}  x  {% endif -%}  \n y",
    "{% if true +%}\nkeep\n  {%+ if true %} lstrip kept{% endif %}{% endif %}",
    "{# comment #}\nafter\n  {# indented comment #}\nz",
    "{{ x }} {{ f }} {{ big }} {{ small }} {{ 1/3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ x * 1.0 }}",
    "{{ none }} {{ true }} {{ d }} {{ l }} {{ (1, 'a') }} {{ undefined_thing }}|{{ [s, uni] }}",
    "{{ d | tojson }} {{ d | tojson(indent=2) }} {{ uni | tojson }} {{ {'k': \"q\\\"\\\\\\n\\t\\u0001\"} | tojson }}",
    "{{ d | tojson(sort_keys=true) }} {{ [1.5, 1e-7, 100000000000000000000.0] | tojson(separators=(',', ':')) }}",
    "[{{ s | trim }}] [{{ s.strip() }}] [{{ s.lstrip() }}] [{{ s.rstrip() }}] [{{ s.strip(' \\n') }}] [{{ uni | trim }}]",
    "{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'abc'.replace('b', 'XY') }}",
    "{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'Hello'.upper() }} {{ 'Hello'.lower() }}",
    "{{ l | length }} {{ s | length }} {{ uni | length }} {{ d | length }} {{ l | join('-') }} {{ l | first }} {{ l | last }}",
    "{% for k, v in d | items %}{{ k }}={{ v }};{% endfor %} {% for k in d %}{{ k }}{% endfor %}",
    "{% for i in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}"
    "{{ loop.previtem }}{{ loop.nextitem }}|{% endfor %}",
    "{% for i in [1, 2, 3, 4, 5] if i is odd %}{{ i }}{{ loop.index }}{{ loop.last }}{% else %}none{% endfor %}"
    "{% for i in [] %}x{% else %}empty{% endfor %}",
    "{% for i in range(6) %}{% if i == 4 %}{% break %}{% endif %}{% if i is even %}{% continue %}{% endif %}{{ i }}{% endfor %}",
    "{% set v = 1 %}{% for i in l %}{% set v = i %}{{ v }}{% endfor %}{{ v }}",
    "{% set ns = namespace(v=1, w='a') %}{% for i in l %}{% set ns.v = ns.v + 1 %}{% endfor %}{{ ns.v }}{{ ns.w }}",
    "{% macro m(a, b='dflt', c=none) %}[{{ a }}|{{ b }}|{{ c }}|{{ x }}]{% endmacro %}{{ m(1) }}{{ m(2, 'B') }}{{ m(3, c=4) }}",
    "{{ l[0] }}{{ l[-1] }}{{ l[5] }}|{{ l[1:] }}{{ l[::-1] }}{{ l[:-1] }}{{ 'héllo'[1] }}{{ 'héllo'[1:3] }}{{ 'abc'[::-1] }}",
    "{{ d.a }}{{ d['b'] }}{{ d.c is defined }}{{ d.get('b') }}{{ d.get('z', 'no') }}{{ d.keys() | list }}{{ d.values() | list }}",
    "{{ x is number }}{{ true is number }}{{ x is integer }}{{ f is float }}{{ s is string }}{{ d is mapping }}{{ l is sequence }}"
    "{{ s is iterable }}{{ none is none }}{{ x is defined }}{{ zz is undefined }}{{ zz is iterable }}{{ zz is sequence }}"
    "{{ false is false }}{{ 0 is false }}{{ enable_thinking is false }}{{ x is divisibleby 3 }}{{ d is not mapping }}",
    "{{ 'a' in 'cat' }}{{ 'b' in d }}{{ 2 in [1, 2] }}{{ 'q' not in l }}{{ 1 == 1.0 }}{{ true == 1 }}{{ 1 < 2 < 3 }}{{ 'a' < 'b' }}",
    "{{ 'a' ~ 1 ~ none ~ zz }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ 'ab' * 3 }} {{ x if x > 2 else 'small' }}{{ 'y' if false }}",
    "{{ not true or false and true }} {{ none or 'dflt' }} {{ '' and 'never' }} {{ -x }} {{ -(1 + 2) * 3 }}",
    "{{ 'it''s' }} {{ \"tab\\there\" }} {{ 'uni\\u00e9\\x41' }} {{ '\\d stays' }}",
    "{{ zz | default('D') }} {{ none | default('D') }} {{ '' | default('D', true) }} {{ s | string | length }}",
    "{{ (d | tojson | safe) ~ '<' }} {{ '<b>' | safe + '<i>' }} {{ 'x' + ('<' | safe) }}",
    "{{ 5 | string + 'x' }} {{ 2.0 | string }} {{ none | string }} {{ true | string }} {{ 1.5 | int }} {{ 3 | float }} {{ -3 | abs }}",
    "{%- set items = [] %}{{ items | length }}{% set t = 'x' %}{% if true %}{% set t = 'y' %}{% endif %}{{ t }}",
    "{{ raise_exception('boom') }}",
    "{{ zz + 'x' }}",
    "{{ zz.attr }}",
    "{{ 1 + 'a' }}",
    "{% for a in 'abc' | items %}{{ a }}{% endfor %}",
    "{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}{% for c in 'hé' %}[{{ c }}]{% endfor %}",
    "{{ dict(a=1, b='x') | tojson }} {{ namespace(a=1).a }} {{ {'z': 1, 'a': 2} | tojson }} {{ {'z': 1}.items() | list }}",
    "{{ 'a\\nb' }}\r\nwindows\rmac\u2028ls\n",
    "trailing newline dropped\n",
    "{% if x %}yes{% elif f %}no{% else %}never{% endif %}{% if not x %}a{% elif x == 3 %}b{% endif %}",
    "{% macro inner(v) %}<{{ v }}>{% endmacro %}{% macro outer(v) %}{{ inner(v ~ late) }}{% endmacro %}"
    "{% set late = '!' %}{{ outer(1) }}",
    "{% for a in [1, 2] %}{% set outer = loop %}{% for b in 'xy' %}{{ outer.index }}{{ loop.index }}{{ b }}{% endfor %}{% endfor %}",
    "{{ -0.0 }} {{ 1e300 * 1e10 }} {{ -1e300 * 1e10 }} {{ 0.1 + 0.2 }} {{ 2 ** -1 }} {{ 10 / 4 }} {{ 1e22 }} {{ 123456789.0 * 1000 }}",
    "{{ d[0] is defined }} {{ l['x'] is defined }} {{ none.x is defined }} {{ 's'.nothing is defined }} {{ d.items is defined }}",
    "{{ [[], {}, [{}]] | tojson(indent=2) }} {{ '\u007f\u2028\u00e9\U0001F600' | tojson }} {{ [1, 'a'] | tojson(indent=0) }}",
    "{% if zz is defined and zz.y %}no{% else %}ok{% endif %} {{ not 'a' in l }} {{ -x | abs }} {{ not x is none }}",
    "\u3000 {%- if true %}x{% endif %}|a {% if true %}b{% endif %}|\n\t {% if true %}c{% endif %}|{{- ' d' }}",
    "{{\n  'multi'\n  ~ 'line'\n}}{%\n  if true\n%}\nyes{% endif %}",
    "{{ 'a' == ('a' | safe) }} {{ ('<' | safe) ~ '<' }} {{ ('x' | safe) | trim }} {{ 'abc' | replace('b', '') | upper }}",
    "{% set ns = namespace(items=[]) %}{% for m in l %}{% set ns.items = ns.items + [m] %}{% endfor %}{{ ns.items }}",
    "{{ x > 2 and x < 4 }} {{ 3 in [3.0] }} {{ [1, 2] == [1, 2.0] }} {{ {'a': 1} == {'a': 1} }} {{ 'b' > 'a' }}",
    "{{ ('a', 'b') | join(', ') }} {{ l | list | length }} {{ (l | first) + (l | last) }} {{ 'x' | list }}",
    "{{ 'ß' | length }}{{ '🎉'[0] }}{{ '  x\u3000' | trim }}|{{ '\u00a0y\u00a0'.strip() }}|{{ 'a\u2028b'.split() }}",
]


def assistant_mask(text_, enc):
    spans = []
    for m in re.finditer(r"<\|im_start\|>assistant\n", text_):
        end = text_.find("<|im_end|>", m.end())
        spans.append((m.end(), len(text_) if end < 0 else end + len("<|im_end|>")))
    return [int(any(a < e and b > s for s, e in spans)) for (a, b) in enc.offsets]


def main():
    template_dir, tokenizer_dir, out_path = sys.argv[1:4]
    per_template = int(sys.argv[4]) if len(sys.argv) > 4 else 300
    toks = {name: tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, name, "tokenizer.json"))
            for name in ("qwen2", "qwen3_5")}
    names = sorted(f for f in os.listdir(template_dir) if f.startswith("Qwen") and f.endswith(".jinja"))
    if not names:
        sys.exit("no Qwen*.jinja in " + template_dir)
    with open(out_path, "w", encoding="utf-8") as out:
        for k, source in enumerate(SNIPPETS):
            case = {"template": "snippet:%d" % k, "source": source, "messages": [{"role": "user", "content": "u"}],
                    "tools": None, "add_generation_prompt": False, "extra": SNIPPET_VARS}
            try:
                rendered, _ = render_jinja_template(conversations=[case["messages"]], chat_template=source,
                                                    **SNIPPET_VARS)
                case["rendered"] = rendered[0]
            except Exception as e:  # noqa: BLE001
                case["error"] = "%s: %s" % (type(e).__name__, e)
            out.write(json.dumps(case, ensure_ascii=False) + "\n")
        for t_index, name in enumerate(names):
            with open(os.path.join(template_dir, name), encoding="utf-8", newline="") as f:
                source = f.read()
            tok = toks["qwen3_5" if name.startswith("Qwen3.5") else "qwen2"]
            rng = random.Random(1000 + t_index)
            for i in range(per_template):
                msgs, tools = conversation(rng, name)
                agp = i % 2 == 1
                extra = {}
                if rng.random() < 0.6:
                    extra["enable_thinking"] = rng.random() < 0.5
                case = {"template": name, "messages": msgs, "tools": tools, "add_generation_prompt": agp, "extra": extra}
                try:
                    conv = _normalize_chat_messages(json.loads(json.dumps(msgs)))
                    rendered, _ = render_jinja_template(conversations=[conv], tools=tools, chat_template=source,
                                                        add_generation_prompt=agp, **extra)
                    case["rendered"] = rendered[0]
                    if not agp:
                        enc = tok.encode(rendered[0], add_special_tokens=False)
                        case["ids"] = enc.ids
                        case["mask"] = assistant_mask(rendered[0], enc)
                except Exception as e:  # noqa: BLE001 (what the template raises is the expected outcome)
                    case["error"] = "%s: %s" % (type(e).__name__, e)
                out.write(json.dumps(case, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
