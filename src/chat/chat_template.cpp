#include "chat/chat_template.h"

#include <fstream>
#include <sstream>
#include <stdexcept>

namespace hs::chat {

namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// tokenizer_config.json writes a special token as a string or as an AddedToken object {"content": ...}.
std::optional<std::string> special_token(const nlohmann::json& cfg, const char* key) {
  if (!cfg.contains(key)) return std::nullopt;
  const auto& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

// transformers' _normalize_chat_messages (keys whose value is None dropped) and _alias_reasoning_fields (the
// reasoning under "reasoning_content", "thinking" or "reasoning" copied to "thinking" first and "reasoning_content").
Value prepare_messages(const Value& messages) {
  if (!messages.is_list()) throw std::invalid_argument("the messages must be a JSON array of message objects");
  if (messages.list->empty())
    throw std::invalid_argument("Cannot apply chat template to an empty conversation. Provide at least one message.");
  List out;
  for (const Value& m : *messages.list) {
    if (!m.is_dict()) throw std::invalid_argument("a message must be a JSON object, not " + m.repr());
    Dict d;
    for (const auto& [k, v] : m.dict->items)
      if (!v.is_none()) d.items.emplace_back(k, v);
    const Value* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"})
      if ((reasoning = d.find(key))) break;
    if (reasoning) {
      const Value r = *reasoning;
      Dict aliased;
      aliased.items.emplace_back("thinking", r);
      for (const auto& [k, v] : d.items) aliased.set(k, v);
      aliased.set("thinking", r);
      aliased.set("reasoning_content", r);
      d = std::move(aliased);
    }
    out.push_back(Value::make_dict(std::move(d)));
  }
  return Value::make_list(std::move(out));
}

}  // namespace

ChatTemplate ChatTemplate::parse(std::string source, std::string origin) {
  ChatTemplate t;
  t.program_ = parse_template(source, origin);
  t.source_ = std::move(source);
  t.origin_ = std::move(origin);
  return t;
}

void ChatTemplate::set_special_tokens(std::optional<std::string> bos, std::optional<std::string> eos) {
  bos_ = std::move(bos);
  eos_ = std::move(eos);
}

ChatTemplate ChatTemplate::load(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw std::runtime_error(path.string() + " does not exist");
  const bool config_file = !fs::is_directory(path, ec) && path.extension() == ".json";
  if (!fs::is_directory(path, ec) && !config_file) return parse(read_file(path), path.string());
  nlohmann::json cfg;
  const fs::path cfg_path = config_file ? path : path / "tokenizer_config.json";
  if (fs::exists(cfg_path, ec)) {
    try {
      cfg = nlohmann::json::parse(read_file(cfg_path));
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(cfg_path.string() + " is not valid JSON: " + e.what());
    }
  }
  ChatTemplate t;
  const fs::path jinja = path / "chat_template.jinja";
  if (!config_file && fs::exists(jinja, ec)) {
    t = parse(read_file(jinja), jinja.string());
  } else if (cfg.is_object() && cfg.contains("chat_template")) {
    const auto& ct = cfg["chat_template"];
    const std::string origin = cfg_path.string() + " (chat_template)";
    if (ct.is_string()) {
      t = parse(ct.get<std::string>(), origin);
    } else if (ct.is_array()) {
      const nlohmann::json* found = nullptr;
      for (const auto& e : ct)
        if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
          found = &e["template"];
      if (!found)
        throw std::runtime_error(cfg_path.string() +
                                 ": chat_template is a list of named templates without one named "
                                 "\"default\"");
      t = parse(found->get<std::string>(), origin);
    } else {
      throw std::runtime_error(cfg_path.string() +
                               ": chat_template is neither a string nor a list of {name, template}");
    }
  } else {
    throw std::runtime_error("no chat template in " + path.string() +
                             ": it has neither chat_template.jinja nor a \"chat_template\" in tokenizer_config.json "
                             "(copy the template of the model it was trained from into chat_template.jinja)");
  }
  if (cfg.is_object()) t.set_special_tokens(special_token(cfg, "bos_token"), special_token(cfg, "eos_token"));
  return t;
}

std::string ChatTemplate::render_values(const Value& messages, const Value& tools, const Value& extra,
                                        bool add_generation_prompt) const {
  if (!tools.is_none() && !tools.is_list())
    throw std::invalid_argument("tools must be null or a JSON array of tool schemas");
  if (!extra.is_none() && !extra.is_dict())
    throw std::invalid_argument("the extra template variables must be a JSON object");
  Dict vars;
  vars.set("messages", prepare_messages(messages));
  vars.set("tools", tools);
  vars.set("documents", Value::none());
  vars.set("add_generation_prompt", Value::boolean(add_generation_prompt));
  // transformers: {**special_tokens_map, **kwargs}, so a variable in `extra` wins over a special token.
  if (bos_) vars.set("bos_token", Value::string(*bos_));
  if (eos_) vars.set("eos_token", Value::string(*eos_));
  if (extra.is_dict())
    for (const auto& [k, v] : extra.dict->items) {
      if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt")
        throw std::invalid_argument("'" + k + "' cannot be an extra template variable: it has its own argument");
      vars.set(k, v);
    }
  return render_template(*program_, vars);
}

std::string ChatTemplate::render(const nlohmann::json& messages, const RenderOptions& opt) const {
  return render_values(from_json(messages), from_json(opt.tools), from_json(opt.extra), opt.add_generation_prompt);
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const RenderOptions& opt,
                                 const nlohmann::ordered_json& tools, const nlohmann::ordered_json& extra) const {
  return render_values(from_json(messages), tools.is_null() ? from_json(opt.tools) : from_json(tools),
                       extra.is_null() ? from_json(opt.extra) : from_json(extra), opt.add_generation_prompt);
}

}  // namespace hs::chat
