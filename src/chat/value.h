// The values a chat template computes with, as Python and Jinja see them: undefined, None, bool, int, float, str
// (with Markup's flag), list (and tuple), dict (insertion-ordered, string keys), namespace, and callables (macros,
// globals, bound methods). Lists and dicts are shared and never changed (the sandbox transformers uses is
// immutable); a namespace is shared and changed by `set ns.attr = ...`.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace hs::chat {

struct Value;
using List = std::vector<Value>;
// Insertion-ordered, as Python's dict: templates print JSON from it (tojson), where the order shows.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value v);
};
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using Function = std::function<Value(Args&, Kwargs&)>;

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, Array, Map, Namespace, Callable };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;        // String; for Undefined, what was looked up (for its error)
  bool markup = false;  // String: a Markup (from |safe), which escapes a plain str it is added to
  bool tuple = false;   // List: a tuple (from |items, unpacking), printed with parentheses
  std::shared_ptr<const List> list;
  std::shared_ptr<Dict> dict;  // Dict (never changed) or Namespace (changed by set ns.x)
  std::shared_ptr<const Function> fn;

  static Value undefined(std::string what = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v, bool markup = false);
  static Value make_list(List v, bool tuple = false);
  static Value make_dict(Dict v);
  static Value make_namespace(Dict v);
  static Value callable(Function f);

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_string() const { return kind == Kind::String; }
  bool is_list() const { return kind == Kind::Array; }
  bool is_dict() const { return kind == Kind::Map; }
  bool is_number() const { return kind == Kind::Bool || kind == Kind::Int || kind == Kind::Float; }
  bool truthy() const;            // Python's bool()
  std::string type_name() const;  // Python's type name, for errors
  std::string str() const;        // Python's str() (Jinja prints this; undefined prints nothing)
  std::string repr() const;       // Python's repr()
};

bool equal(const Value& a, const Value& b);  // Python's ==

// JSON to template values, keeping the order of an ordered_json's keys.
Value from_json(const nlohmann::json& j);
Value from_json(const nlohmann::ordered_json& j);

// Python's json.dumps(x, ensure_ascii=False, indent, separators, sort_keys): transformers' tojson filter.
// Throws std::invalid_argument for what json.dumps refuses (undefined, callables, namespaces).
std::string to_json(const Value& v, int indent /* <0: none */, const std::string& item_sep, const std::string& key_sep,
                    bool sort_keys);

// Python's repr of a float (shortest round trip; exponent form below 1e-4 and from 1e16).
std::string python_float_repr(double x);

// UTF-8 helpers with Python's code-point semantics.
std::vector<uint32_t> utf8_decode(std::string_view s);
std::string utf8_encode(const std::vector<uint32_t>& cps);
bool python_isspace(uint32_t cp);  // str.isspace(), what strip()/split() without arguments remove

}  // namespace hs::chat
