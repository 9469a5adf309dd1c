#include "chat/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace hs::chat {

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  for (auto& [k, old] : items)
    if (k == key) {
      old = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

Value Value::undefined(std::string what) {
  Value v;
  v.s = std::move(what);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::None;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::Bool;
  v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.kind = Kind::Int;
  v.i = x;
  return v;
}
Value Value::number(double x) {
  Value v;
  v.kind = Kind::Float;
  v.f = x;
  return v;
}
Value Value::string(std::string x, bool markup) {
  Value v;
  v.kind = Kind::String;
  v.s = std::move(x);
  v.markup = markup;
  return v;
}
Value Value::make_list(List x, bool tuple) {
  Value v;
  v.kind = Kind::Array;
  v.list = std::make_shared<const List>(std::move(x));
  v.tuple = tuple;
  return v;
}
Value Value::make_dict(Dict x) {
  Value v;
  v.kind = Kind::Map;
  v.dict = std::make_shared<Dict>(std::move(x));
  return v;
}
Value Value::make_namespace(Dict x) {
  Value v;
  v.kind = Kind::Namespace;
  v.dict = std::make_shared<Dict>(std::move(x));
  return v;
}
Value Value::callable(Function f) {
  Value v;
  v.kind = Kind::Callable;
  v.fn = std::make_shared<const Function>(std::move(f));
  return v;
}

bool Value::truthy() const {
  switch (kind) {
    case Kind::Undefined:
    case Kind::None:
      return false;
    case Kind::Bool:
      return b;
    case Kind::Int:
      return i != 0;
    case Kind::Float:
      return f != 0;
    case Kind::String:
      return !s.empty();
    case Kind::Array:
      return !list->empty();
    case Kind::Map:
      return !dict->items.empty();
    case Kind::Namespace:
    case Kind::Callable:
      return true;
  }
  return false;
}

std::string Value::type_name() const {
  switch (kind) {
    case Kind::Undefined:
      return "Undefined";
    case Kind::None:
      return "NoneType";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Float:
      return "float";
    case Kind::String:
      return markup ? "Markup" : "str";
    case Kind::Array:
      return tuple ? "tuple" : "list";
    case Kind::Map:
      return "dict";
    case Kind::Namespace:
      return "Namespace";
    case Kind::Callable:
      return "function";
  }
  return "?";
}

std::string python_float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);  // shortest round trip
  std::string sci(buf, r.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp10 = std::stoi(sci.substr(e + 1));
  const int decpt = exp10 + 1;  // digits d1 d2 ... = 0.d1d2... * 10^decpt
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(-decpt, '0') + digits;
    } else if (decpt >= static_cast<int>(digits.size())) {
      out = digits + std::string(decpt - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += eb;
  }
  return sign + out;
}

std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    bool ok = true;
    for (int k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 2) ok = false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += n;
  }
  return out;
}

static void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string utf8_encode(const std::vector<uint32_t>& cps) {
  std::string out;
  out.reserve(cps.size());
  for (uint32_t cp : cps) append_utf8(out, cp);
  return out;
}

bool python_isspace(uint32_t cp) {
  // Python's str.isspace(): bidirectional class WS, B or S, or category Zs.
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// What repr() escapes: Python's str.isprintable() is false for categories Cc, Cf, Cs, Co, Cn, Zl, Zp and Zs but
// the space. Covered here: the controls, the separators and the common format characters (docs/chat.md).
static bool repr_escapes(uint32_t cp) {
  if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) return true;
  if (cp != 0x20 && python_isspace(cp)) return true;
  return (cp >= 0x200B && cp <= 0x200F) || (cp >= 0x202A && cp <= 0x202E) || (cp >= 0x2060 && cp <= 0x2064) ||
         cp == 0xFEFF || (cp >= 0xD800 && cp <= 0xDFFF) || (cp >= 0xE000 && cp <= 0xF8FF);
}

static std::string repr_string(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (uint32_t cp : utf8_decode(s)) {
    char buf[16];
    if (cp == static_cast<uint32_t>(q) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (repr_escapes(cp)) {
      std::snprintf(buf, sizeof buf, cp < 0x100 ? "\\x%02x" : "\\u%04x", cp);
      out += buf;
    } else {
      append_utf8(out, cp);
    }
  }
  out += q;
  return out;
}

std::string Value::repr() const {
  switch (kind) {
    case Kind::String:
      return repr_string(s);
    case Kind::Array: {
      std::string out = tuple ? "(" : "[";
      for (size_t k = 0; k < list->size(); ++k) out += (k ? ", " : "") + (*list)[k].repr();
      if (tuple && list->size() == 1) out += ",";
      return out + (tuple ? ")" : "]");
    }
    case Kind::Map: {
      std::string out = "{";
      for (size_t k = 0; k < dict->items.size(); ++k)
        out += (k ? ", " : "") + repr_string(dict->items[k].first) + ": " + dict->items[k].second.repr();
      return out + "}";
    }
    default:
      return str();
  }
}

std::string Value::str() const {
  switch (kind) {
    case Kind::Undefined:
      return "";
    case Kind::None:
      return "None";
    case Kind::Bool:
      return b ? "True" : "False";
    case Kind::Int:
      return std::to_string(i);
    case Kind::Float:
      return python_float_repr(f);
    case Kind::String:
      return s;
    case Kind::Array:
    case Kind::Map:
      return repr();
    case Kind::Namespace: {
      std::string out = "<Namespace {";
      for (size_t k = 0; k < dict->items.size(); ++k)
        out += (k ? ", " : "") + repr_string(dict->items[k].first) + ": " + dict->items[k].second.repr();
      return out + "}>";
    }
    case Kind::Callable:
      return "<function>";
  }
  return "";
}

static bool numeric(const Value& v, double& d, int64_t& i, bool& is_int) {
  if (v.kind == Value::Kind::Bool) return is_int = true, i = v.b, d = v.b, true;
  if (v.kind == Value::Kind::Int) return is_int = true, i = v.i, d = static_cast<double>(v.i), true;
  if (v.kind == Value::Kind::Float) return is_int = false, d = v.f, true;
  return false;
}

bool equal(const Value& a, const Value& b) {
  double da, db;
  int64_t ia, ib;
  bool inta, intb;
  if (numeric(a, da, ia, inta) && numeric(b, db, ib, intb)) return inta && intb ? ia == ib : da == db;
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return true;
    case Value::Kind::String:
      return a.s == b.s;
    case Value::Kind::Array:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::Kind::Map:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    default:
      return a.dict == b.dict && a.fn == b.fn;  // namespaces and callables: identity
  }
}

template <class Json>
static Value convert(const Json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return Value::none();
    case nlohmann::json::value_t::boolean:
      return Value::boolean(j.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value::integer(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const auto u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) throw std::invalid_argument("an integer above 2^63-1 in the chat data");
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Value::number(j.template get<double>());
    case nlohmann::json::value_t::string:
      return Value::string(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const auto& e : j) l.push_back(convert(e));
      return Value::make_list(std::move(l));
    }
    case nlohmann::json::value_t::object: {
      Dict d;
      d.items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) d.items.emplace_back(it.key(), convert(it.value()));
      return Value::make_dict(std::move(d));
    }
    default:
      throw std::invalid_argument("binary data in the chat data");
  }
}

Value from_json(const nlohmann::json& j) { return convert(j); }
Value from_json(const nlohmann::ordered_json& j) { return convert(j); }

static void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

static void dump(std::string& out, const Value& v, int indent, int level, const std::string& item_sep,
                 const std::string& key_sep, bool sort_keys) {
  auto newline = [&](int lv) {
    if (indent >= 0) out += "\n" + std::string(static_cast<size_t>(indent) * lv, ' ');
  };
  switch (v.kind) {
    case Value::Kind::None:
      out += "null";
      return;
    case Value::Kind::Bool:
      out += v.b ? "true" : "false";
      return;
    case Value::Kind::Int:
      out += std::to_string(v.i);
      return;
    case Value::Kind::Float:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f < 0 ? "-Infinity" : "Infinity";
      else
        out += python_float_repr(v.f);
      return;
    case Value::Kind::String:
      json_string(out, v.s);
      return;
    case Value::Kind::Array: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += item_sep;
        newline(level + 1);
        dump(out, (*v.list)[k], indent, level + 1, item_sep, key_sep, sort_keys);
      }
      newline(level);
      out += ']';
      return;
    }
    case Value::Kind::Map: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& it : v.dict->items) items.push_back(&it);
      if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += item_sep;
        newline(level + 1);
        json_string(out, items[k]->first);
        out += key_sep;
        dump(out, items[k]->second, indent, level + 1, item_sep, key_sep, sort_keys);
      }
      newline(level);
      out += '}';
      return;
    }
    default:
      throw std::invalid_argument("Object of type " + v.type_name() + " is not JSON serializable");
  }
}

std::string to_json(const Value& v, int indent, const std::string& item_sep, const std::string& key_sep,
                    bool sort_keys) {
  std::string out;
  dump(out, v, indent, 0, item_sep, key_sep, sort_keys);
  return out;
}

}  // namespace hs::chat
