#include "serve/request.h"

#include <cmath>
#include <limits>

namespace hs::serve {

nlohmann::json ApiError::body() const {
  return {{"error",
           {{"message", what()},
            {"type", type},
            {"param", param.empty() ? nlohmann::json() : nlohmann::json(param)},
            {"code", code.empty() ? nlohmann::json() : nlohmann::json(code)}}}};
}

namespace {

nlohmann::json parse_object(std::string_view body) {
  nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    throw ApiError(400, "the request body is not valid JSON (send a JSON object with Content-Type: application/json)");
  if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object, not " + std::string(j.type_name()));
  return j;
}

const nlohmann::json* field(const nlohmann::json& j, const char* name) {
  auto it = j.find(name);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

[[noreturn]] void wrong_type(const char* name, const char* want, const nlohmann::json& got) {
  throw ApiError(400, std::string("'") + name + "' must be " + want + ", not " + got.type_name(), name);
}

double number(const nlohmann::json& j, const char* name, double lo, double hi) {
  const nlohmann::json* f = field(j, name);
  if (!f) return std::numeric_limits<double>::quiet_NaN();
  if (!f->is_number()) wrong_type(name, "a number", *f);
  const double v = f->get<double>();
  if (!(v >= lo && v <= hi))
    throw ApiError(400, std::string("'") + name + "' must be in [" + nlohmann::json(lo).dump() + ", " +
                            nlohmann::json(hi).dump() + "] (got " + f->dump() + ")",
                   name);
  return v;
}

std::optional<int64_t> integer(const nlohmann::json& j, const char* name) {
  const nlohmann::json* f = field(j, name);
  if (!f) return std::nullopt;
  if (f->is_number_integer()) return f->get<int64_t>();
  if (f->is_number_unsigned()) {
    if (f->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw ApiError(400, std::string("'") + name + "' is too large", name);
    return static_cast<int64_t>(f->get<uint64_t>());
  }
  wrong_type(name, "an integer", *f);
}

bool boolean(const nlohmann::json& j, const char* name, bool dflt) {
  const nlohmann::json* f = field(j, name);
  if (!f) return dflt;
  if (!f->is_boolean()) wrong_type(name, "true or false", *f);
  return f->get<bool>();
}

// A message's content: a string, or an array of {"type": "text", "text": ...} parts (joined).
std::string content_text(const nlohmann::json& c) {
  if (c.is_string()) return c.get<std::string>();
  if (c.is_array()) {
    std::string out;
    for (const auto& part : c) {
      if (!part.is_object() || part.value("type", nlohmann::json()) != "text" || !part.contains("text") ||
          !part["text"].is_string())
        throw ApiError(400, "a message's content parts must be {\"type\": \"text\", \"text\": string} (only text is "
                            "supported)",
                       "messages");
      out += part["text"].get<std::string>();
    }
    return out;
  }
  if (c.is_null()) return "";
  throw ApiError(400, std::string("a message's content must be a string or an array of text parts, not ") +
                          c.type_name(),
                 "messages");
}

nlohmann::json parse_messages(const nlohmann::json& m) {
  if (!m.is_array()) wrong_type("messages", "an array of {role, content}", m);
  if (m.empty()) throw ApiError(400, "'messages' is empty: give at least one message", "messages");
  nlohmann::json out = nlohmann::json::array();
  for (const auto& x : m) {
    if (!x.is_object()) throw ApiError(400, "each message must be an object {role, content}", "messages");
    const nlohmann::json* role = field(x, "role");
    if (!role || !role->is_string())
      throw ApiError(400, "each message needs a 'role' string (system, user, assistant or tool)", "messages");
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant" && r != "tool" && r != "developer")
      throw ApiError(400, "unknown message role '" + r + "' (system, user, assistant, tool or developer)",
                     "messages");
    out.push_back({{"role", r}, {"content", content_text(x.value("content", nlohmann::json()))}});
  }
  return out;
}

}  // namespace

CompletionRequest parse_completion(std::string_view body, Endpoint endpoint) {
  const nlohmann::json j = parse_object(body);
  CompletionRequest r;
  r.endpoint = endpoint;
  if (const nlohmann::json* m = field(j, "model")) {
    if (!m->is_string()) wrong_type("model", "a string", *m);
    r.model = m->get<std::string>();
  }
  if (endpoint == Endpoint::Chat) {
    const nlohmann::json* m = field(j, "messages");
    if (!m) throw ApiError(400, "'messages' is missing: a chat completion needs [{\"role\", \"content\"}]", "messages");
    r.messages = parse_messages(*m);
  } else {
    const nlohmann::json* p = field(j, "prompt");
    if (!p) throw ApiError(400, "'prompt' is missing: give a string or an array of token ids", "prompt");
    if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) p = &(*p)[0];
    if (p->is_array() && p->size() == 1 && (*p)[0].is_array()) p = &(*p)[0];
    if (p->is_string()) {
      r.prompt = p->get<std::string>();
    } else if (p->is_array()) {
      r.prompt_is_ids = true;
      for (const auto& x : *p) {
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > std::numeric_limits<int32_t>::max())
          throw ApiError(400, "'prompt' must be one string or one array of non-negative token ids (one prompt per "
                              "request)",
                         "prompt");
        r.prompt_ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
      }
    } else {
      wrong_type("prompt", "a string or an array of token ids", *p);
    }
    if (r.prompt.empty() && r.prompt_ids.empty()) throw ApiError(400, "'prompt' is empty", "prompt");
  }
  r.max_tokens = integer(j, "max_completion_tokens");
  if (auto m = integer(j, "max_tokens")) r.max_tokens = m;
  if (r.max_tokens && *r.max_tokens <= 0)
    throw ApiError(400, "'max_tokens' must be at least 1 (got " + std::to_string(*r.max_tokens) + ")", "max_tokens");
  if (double t = number(j, "temperature", 0, 2); !std::isnan(t)) r.temperature = t;
  if (double p = number(j, "top_p", 0, 1); !std::isnan(p)) {
    if (p <= 0) throw ApiError(400, "'top_p' must be in (0, 1]", "top_p");
    r.top_p = p;
  }
  if (auto k = integer(j, "top_k")) {
    if (*k < 0) throw ApiError(400, "'top_k' must be >= 0 (0: all tokens)", "top_k");
    r.top_k = *k;
  }
  if (const nlohmann::json* s = field(j, "seed")) {
    if (s->is_number_integer()) r.seed = static_cast<uint64_t>(s->get<int64_t>());
    else if (s->is_number_unsigned()) r.seed = s->get<uint64_t>();
    else wrong_type("seed", "an integer", *s);
  }
  if (const nlohmann::json* s = field(j, "stop")) {
    if (s->is_string()) r.stop.push_back(s->get<std::string>());
    else if (s->is_array()) {
      for (const auto& x : *s) {
        if (!x.is_string()) throw ApiError(400, "'stop' must be a string or an array of strings", "stop");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      wrong_type("stop", "a string or an array of strings", *s);
    }
    if (r.stop.size() > 16) throw ApiError(400, "at most 16 stop strings", "stop");
    for (const auto& x : r.stop)
      if (x.empty()) throw ApiError(400, "a stop string is empty", "stop");
  }
  r.stream = boolean(j, "stream", false);
  if (const nlohmann::json* o = field(j, "stream_options")) {
    if (!o->is_object()) wrong_type("stream_options", "an object", *o);
    r.include_usage = boolean(*o, "include_usage", true);
  }
  if (auto n = integer(j, "n"); n && *n != 1) throw ApiError(400, "only n = 1 is supported", "n");
  // Chat: logprobs true/false and top_logprobs 0..20; completions: logprobs an integer 0..5 (the top count).
  if (endpoint == Endpoint::Chat) {
    r.logprobs = boolean(j, "logprobs", false);
    if (auto t = integer(j, "top_logprobs")) {
      if (*t < 0 || *t > 20) throw ApiError(400, "'top_logprobs' must be in [0, 20]", "top_logprobs");
      if (!r.logprobs) throw ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs");
      r.top_logprobs = *t;
    }
  } else if (const nlohmann::json* l = field(j, "logprobs")) {
    if (l->is_boolean()) {
      r.logprobs = l->get<bool>();
    } else if (l->is_number_integer()) {
      const int64_t t = l->get<int64_t>();
      if (t < 0 || t > 20) throw ApiError(400, "'logprobs' must be in [0, 20]", "logprobs");
      r.logprobs = true;
      r.top_logprobs = t;
    } else {
      wrong_type("logprobs", "an integer", *l);
    }
  }
  r.return_tokens = boolean(j, "return_tokens", false);
  r.ignore_eos = boolean(j, "ignore_eos", false);
  return r;
}

TokenizeRequest parse_tokenize(std::string_view body) {
  const nlohmann::json j = parse_object(body);
  TokenizeRequest r;
  if (const nlohmann::json* m = field(j, "messages")) {
    r.messages = parse_messages(*m);
    r.add_generation_prompt = boolean(j, "add_generation_prompt", true);
  } else if (const nlohmann::json* c = field(j, "content")) {
    if (!c->is_string()) wrong_type("content", "a string", *c);
    r.content = c->get<std::string>();
  } else {
    throw ApiError(400, "give 'content' (a string) or 'messages'", "content");
  }
  return r;
}

std::vector<int32_t> parse_detokenize(std::string_view body) {
  const nlohmann::json j = parse_object(body);
  const nlohmann::json* t = field(j, "tokens");
  if (!t) throw ApiError(400, "'tokens' is missing: give an array of token ids", "tokens");
  if (!t->is_array()) wrong_type("tokens", "an array of token ids", *t);
  std::vector<int32_t> ids;
  for (const auto& x : *t) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > std::numeric_limits<int32_t>::max())
      throw ApiError(400, "'tokens' must hold non-negative integers", "tokens");
    ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
  }
  return ids;
}

}  // namespace hs::serve
