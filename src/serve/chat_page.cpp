#include "serve/chat_page.h"

namespace hs::serve {

// One self-contained page (no build step, no external script or font): the conversation streams through
// POST /v1/chat/completions like any client's, and each answer shows its tokens/s and the prompt tokens the prefix
// cache served (usage.prompt_tokens_details.cached_tokens).
const char* const kChatPage = R"HTML(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>hybridscan chat</title>
<style>
  body { font: 15px/1.45 system-ui, sans-serif; margin: 0; background: #f6f6f4; color: #222; }
  header { padding: 10px 16px; background: #263238; color: #eceff1; display: flex; gap: 16px; align-items: center; }
  header b { font-size: 16px; }
  header input { width: 160px; }
  #log { max-width: 860px; margin: 0 auto; padding: 16px; }
  .msg { white-space: pre-wrap; padding: 10px 12px; margin: 8px 0; border-radius: 8px; }
  .user { background: #dcedc8; }
  .assistant { background: #fff; border: 1px solid #ddd; }
  .stats { font-size: 12px; color: #666; margin: -4px 0 10px 4px; }
  form { max-width: 860px; margin: 0 auto; padding: 0 16px 24px; display: flex; gap: 8px; }
  textarea { flex: 1; font: inherit; padding: 8px; height: 60px; }
  button { font: inherit; padding: 0 18px; }
</style>
</head>
<body>
<header><b>hybridscan</b><span id="model"></span>
  <label>max tokens <input id="max" type="number" value="256" min="1" style="width:70px"></label>
  <label>temperature <input id="temp" type="number" value="0" step="0.1" min="0" max="2" style="width:60px"></label>
  <label>API key <input id="key" type="password" placeholder="(none)"></label>
  <button id="clear" type="button">new chat</button></header>
<div id="log"></div>
<form id="form"><textarea id="input" placeholder="Message (Enter sends, Shift+Enter: new line)"></textarea>
  <button id="send">Send</button></form>
<script>
"use strict";
const log = document.getElementById("log"), input = document.getElementById("input");
let messages = [], model = "";
function headers() {
  const h = {"Content-Type": "application/json"}, k = document.getElementById("key").value;
  if (k) h["Authorization"] = "Bearer " + k;
  return h;
}
function add(cls, text) {
  const d = document.createElement("div");
  d.className = "msg " + cls; d.textContent = text; log.appendChild(d); return d;
}
fetch("/v1/models", {headers: headers()}).then(r => r.json()).then(j => {
  model = j.data[0].id; document.getElementById("model").textContent = model;
}).catch(() => {});
document.getElementById("clear").onclick = () => { messages = []; log.textContent = ""; };
input.addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); document.getElementById("form").requestSubmit(); }
});
document.getElementById("form").onsubmit = async e => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  messages.push({role: "user", content: text});
  add("user", text);
  const out = add("assistant", ""), stats = document.createElement("div");
  stats.className = "stats"; log.appendChild(stats);
  const t0 = performance.now();
  let first = 0, tokens = 0, answer = "", usage = null;
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify({
      model, messages, stream: true, max_tokens: +document.getElementById("max").value,
      temperature: +document.getElementById("temp").value})});
    if (!r.ok) { const j = await r.json(); throw new Error(j.error ? j.error.message : r.status); }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, at); buf = buf.slice(at + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const j = JSON.parse(line.slice(6));
        if (j.error) throw new Error(j.error.message);
        if (j.usage) usage = j.usage;
        for (const c of j.choices || []) {
          if (c.delta && c.delta.content) {
            if (!first) first = performance.now();
            answer += c.delta.content; out.textContent = answer; ++tokens;
          }
        }
      }
    }
    messages.push({role: "assistant", content: answer});
    const n = usage ? usage.completion_tokens : tokens, s = (performance.now() - (first || t0)) / 1000;
    stats.textContent = n + " tokens, " + (n > 1 && s > 0 ? ((n - 1) / s).toFixed(1) : "-") +
      " tokens/s, first token " +
      ((first - t0) / 1000).toFixed(2) + " s, prompt " + (usage ? usage.prompt_tokens : "?") + " tokens of which " +
      (usage ? usage.prompt_tokens_details.cached_tokens : "?") + " from the cache";
    stats.id = "stats-" + messages.length;
  } catch (err) {
    out.textContent = answer + " [error: " + err.message + "]";
    messages.pop();
  }
};
</script>
</body>
</html>
)HTML";

}  // namespace hs::serve
