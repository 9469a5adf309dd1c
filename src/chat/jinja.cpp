#include "chat/jinja.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <map>
#include <set>
#include <unordered_map>

namespace hs::chat {

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Errors. EvalError: what a Python exception would be at render time, without the line; the statement that was
// running adds its line when it turns it into a TemplateError.
struct EvalError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void fail(const std::string& msg) { throw EvalError(msg); }

std::string where(const std::string& origin, int line) { return origin + ", line " + std::to_string(line) + ": "; }

[[noreturn]] void not_implemented(const std::string& origin, int line, const std::string& what) {
  throw TemplateError(where(origin, line) + what +
                      " is not implemented by hybridscan's chat template renderer (docs/chat.md lists what is)");
}

// ---------------------------------------------------------------------------------------------------------------
// Source normalisation: jinja2's lexer splits the source at "\r\n", "\r" and "\n", joins the lines with "\n", and
// (keep_trailing_newline=False) drops one final line break.
std::string normalise_newlines(const std::string& src) {
  std::string out;
  out.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == '\r') {
      out += '\n';
      if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
    } else {
      out += src[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// Python's str.rstrip() / the regex \s* after "-%}", on UTF-8.
size_t rstrip_space_end(const std::string& s) {
  auto cps = utf8_decode(s);
  while (!cps.empty() && python_isspace(cps.back())) cps.pop_back();
  return utf8_encode(cps).size();
}
size_t skip_space(const std::string& s, size_t pos) {
  while (pos < s.size()) {
    const auto c = static_cast<unsigned char>(s[pos]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
    const auto cp = utf8_decode(std::string_view(s).substr(pos, std::min(n, s.size() - pos)));
    if (cp.size() != 1 || !python_isspace(cp[0])) break;
    pos += n;
  }
  return pos;
}

// ---------------------------------------------------------------------------------------------------------------
// Lexer.
enum class Tok { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };
struct Token {
  Token(Tok type_, std::string text_, int line_) : type(type_), text(std::move(text_)), line(line_) {}
  Tok type;
  std::string text;
  int line;
  int64_t i = 0;
  double f = 0;
};

std::string unescape_string(const std::string& body, const std::string& origin, int line) {
  // jinja2: value.encode("ascii", "backslashreplace").decode("unicode-escape")
  std::string out;
  for (size_t k = 0; k < body.size(); ++k) {
    if (body[k] != '\\' || k + 1 >= body.size()) {
      out += body[k];
      continue;
    }
    const char e = body[++k];
    auto hex = [&](int n) {
      uint32_t v = 0;
      for (int d = 1; d <= n; ++d) {
        const char h = k + d < body.size() ? body[k + d] : 'x';
        if (!std::isxdigit(static_cast<unsigned char>(h)))
          throw TemplateError(where(origin, line) + "bad escape in a string");
        v = v * 16 +
            static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      k += n;
      out += utf8_encode({v});
    };
    switch (e) {
      case '\n':
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
        hex(2);
        break;
      case 'u':
        hex(4);
        break;
      case 'U':
        hex(8);
        break;
      case 'N':
        not_implemented(origin, line, "the \\N{...} escape");
      default:
        if (e >= '0' && e <= '7') {
          uint32_t v = static_cast<uint32_t>(e - '0');
          for (int d = 0; d < 2 && k + 1 < body.size() && body[k + 1] >= '0' && body[k + 1] <= '7'; ++d)
            v = v * 8 + static_cast<uint32_t>(body[++k] - '0');
          out += utf8_encode({v});
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

std::vector<Token> lex(const std::string& src, const std::string& origin) {
  std::vector<Token> toks;
  size_t pos = 0;
  int line = 1;
  bool line_starting = true;
  auto count_lines = [](const std::string& s, size_t a, size_t b) {
    return static_cast<int>(std::count(s.begin() + static_cast<long>(a), s.begin() + static_cast<long>(b), '\n'));
  };
  while (pos < src.size()) {
    size_t p = pos;
    while (true) {
      p = src.find('{', p);
      if (p == std::string::npos || p + 1 >= src.size()) {
        p = std::string::npos;
        break;
      }
      if (src[p + 1] == '{' || src[p + 1] == '%' || src[p + 1] == '#') break;
      ++p;
    }
    if (p == std::string::npos) {
      toks.push_back({Tok::Data, src.substr(pos), line});
      break;
    }
    std::string text = src.substr(pos, p - pos);
    const int text_line = line;
    line += count_lines(src, pos, p);
    const char kind = src[p + 1];
    size_t q = p + 2;
    const char sign = q < src.size() && (src[q] == '-' || src[q] == '+') ? src[q] : 0;
    if (sign) ++q;
    if (sign == '-') {
      text.resize(rstrip_space_end(text));
    } else if (sign != '+' && kind != '{') {  // lstrip_blocks
      const size_t l_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
      if ((l_pos > 0 || line_starting) && text.find_first_not_of(" \t", l_pos) == std::string::npos) text.resize(l_pos);
    }
    if (!text.empty()) toks.push_back({Tok::Data, text, text_line});
    if (kind == '#') {
      const size_t e = src.find("#}", q);
      if (e == std::string::npos) throw TemplateError(where(origin, line) + "a comment is not closed (no #})");
      line += count_lines(src, q, e);
      size_t after = e + 2;
      if (e > q && src[e - 1] == '-') {
        after = skip_space(src, after);
      } else if (!(e > q && src[e - 1] == '+') && after < src.size() && src[after] == '\n') {
        ++after;  // trim_blocks
      }
      line += count_lines(src, e, after);
      line_starting = after > 0 && src[after - 1] == '\n';
      pos = after;
      continue;
    }
    const bool block = kind == '%';
    toks.push_back({block ? Tok::BlockBegin : Tok::VarBegin, "", line});
    while (true) {
      while (q < src.size() && std::isspace(static_cast<unsigned char>(src[q]))) {
        if (src[q] == '\n') ++line;
        ++q;
      }
      if (q >= src.size())
        throw TemplateError(where(origin, line) +
                            (block ? "a block tag is not closed (no %})" : "an expression is not closed (no }})"));
      auto at = [&](const char* s) { return src.compare(q, std::strlen(s), s) == 0; };
      const char* end = block ? "%}" : "}}";
      const bool strip = at(block ? "-%}" : "-}}"), keep = block && at("+%}");
      if (strip || keep || at(end)) {
        size_t after = q + (strip || keep ? 3 : 2);
        if (strip)
          after = skip_space(src, after);
        else if (block && !keep && after < src.size() && src[after] == '\n')
          ++after;  // trim_blocks
        line += count_lines(src, q, after);
        toks.push_back({block ? Tok::BlockEnd : Tok::VarEnd, "", line});
        line_starting = src[after - 1] == '\n';
        pos = after;
        break;
      }
      const char c = src[q];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = q;
        while (e < src.size() && (std::isalnum(static_cast<unsigned char>(src[e])) || src[e] == '_')) ++e;
        toks.push_back({Tok::Name, src.substr(q, e - q), line});
        q = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = q;
        while (e < src.size() && (std::isdigit(static_cast<unsigned char>(src[e])) || src[e] == '_')) ++e;
        bool is_float = false;
        if (e + 1 < src.size() && src[e] == '.' && std::isdigit(static_cast<unsigned char>(src[e + 1]))) {
          is_float = true;
          ++e;
          while (e < src.size() && (std::isdigit(static_cast<unsigned char>(src[e])) || src[e] == '_')) ++e;
        }
        if (e < src.size() && (src[e] == 'e' || src[e] == 'E')) {
          size_t x = e + 1;
          if (x < src.size() && (src[x] == '+' || src[x] == '-')) ++x;
          if (x < src.size() && std::isdigit(static_cast<unsigned char>(src[x]))) {
            is_float = true;
            e = x;
            while (e < src.size() && std::isdigit(static_cast<unsigned char>(src[e]))) ++e;
          }
        }
        std::string num = src.substr(q, e - q);
        num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
        Token t{is_float ? Tok::Float : Tok::Int, num, line};
        try {
          if (is_float)
            t.f = std::stod(num);
          else
            t.i = std::stoll(num);
        } catch (const std::out_of_range&) {
          not_implemented(origin, line, "the number " + num + " (beyond 64 bits)");
        }
        toks.push_back(t);
        q = e;
      } else if (c == '\'' || c == '"') {
        size_t e = q + 1;
        while (e < src.size() && src[e] != c) e += src[e] == '\\' ? 2 : 1;
        if (e >= src.size()) throw TemplateError(where(origin, line) + "a string is not closed");
        const std::string body = src.substr(q + 1, e - q - 1);
        toks.push_back({Tok::String, unescape_string(body, origin, line), line});
        line += count_lines(src, q, e);
        q = e + 1;
      } else {
        static const char* ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                    ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
        const char* found = nullptr;
        for (const char* o : ops)
          if (at(o)) {
            found = o;
            break;
          }
        if (!found) throw TemplateError(where(origin, line) + "unexpected character '" + std::string(1, c) + "'");
        toks.push_back({Tok::Op, found, line});
        q += std::strlen(found);
      }
    }
  }
  toks.push_back({Tok::End, "", line});
  return toks;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// The syntax tree.
struct Expr {
  enum Kind {
    Const,
    Name,
    GetAttr,
    GetItem,
    Slice,
    Call,
    Filter,
    Test,
    Neg,
    Pos,
    Not,
    And,
    Or,
    Binary,
    Concat,
    Compare,
    Cond,
    ListLit,
    TupleLit,
    DictLit
  } kind;
  int line = 0;
  Value constant;                           // Const
  std::string name;                         // Name, GetAttr, Filter, Test, Binary's operator
  std::vector<std::unique_ptr<Expr>> kids;  // operands; Call/Filter/Test: [callee/input, args...]
  std::vector<std::string> kwnames;         // Call/Filter/Test: names of the trailing keyword arguments
  std::vector<std::string> ops;             // Compare's operators
  bool negate = false;                      // Test: "is not"
  bool has_else = false;                    // Cond
};
using ExprPtr = std::unique_ptr<Expr>;

struct Stmt {
  enum Kind { Text, Print, If, For, Set, SetAttr, Macro, Break, Continue, Generation } kind = Text;
  int line = 0;
  std::string text;                       // Text; Set/Macro: the name; SetAttr: the namespace's name
  std::string attr;                       // SetAttr
  std::vector<std::string> targets;       // For
  std::vector<ExprPtr> exprs;             // Print/Set: [value]; If: conditions; For: [iterable, filter?]
  std::vector<std::vector<Stmt>> bodies;  // If: one per condition, then else; For: [body, else]; Macro: [body]
  std::vector<std::string> params;        // Macro
  std::vector<ExprPtr> defaults;          // Macro: one per parameter (null: none)
};

Stmt make_stmt(Stmt::Kind k, int line) {
  Stmt s;
  s.kind = k;
  s.line = line;
  return s;
}

struct Program {
  std::string origin;
  std::vector<Stmt> body;
};

namespace {

const std::set<std::string> kFilters = {
    "tojson", "safe", "string", "trim",  "length",  "count", "items", "default", "d",          "join", "first",
    "last",   "list", "lower",  "upper", "replace", "int",   "float", "abs",     "capitalize", "e",    "escape"};
const std::set<std::string> kTests = {
    "defined",     "undefined", "none", "string", "mapping",  "iterable", "sequence", "number",      "integer",
    "float",       "boolean",   "true", "false",  "callable", "odd",      "even",     "divisibleby", "eq",
    "equalto",     "==",        "ne",   "!=",     "lt",       "<",        "lessthan", "gt",          ">",
    "greaterthan", "le",        "<=",   "ge",     ">=",       "in",       "sameas",   "lower",       "upper"};

class Parser {
 public:
  Parser(std::vector<Token> toks, std::string origin) : t_(std::move(toks)), origin_(std::move(origin)) {}

  std::vector<Stmt> parse_all() {
    std::string end;
    auto body = parse_body({}, end);
    return body;
  }

 private:
  std::vector<Token> t_;
  size_t p_ = 0;
  std::string origin_;
  int depth_ = 0;  // nesting of blocks and expressions: bounded, so that no input can exhaust the stack
  struct Nest {
    explicit Nest(Parser& p) : parser(p) {
      if (++parser.depth_ > kMaxDepth) parser.syntax("nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    ~Nest() { --parser.depth_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;
    Parser& parser;
  };
  static constexpr int kMaxDepth = 200;

  const Token& peek(size_t k = 0) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[p_ < t_.size() - 1 ? p_++ : p_]; }
  [[noreturn]] void syntax(const std::string& msg) const {
    throw TemplateError(where(origin_, peek().line) + "syntax error: " + msg);
  }
  bool is_op(const char* o, size_t k = 0) const { return peek(k).type == Tok::Op && peek(k).text == o; }
  bool is_name(const char* n, size_t k = 0) const { return peek(k).type == Tok::Name && peek(k).text == n; }
  void expect_op(const char* o) {
    if (!is_op(o)) syntax(std::string("expected '") + o + "', found '" + peek().text + "'");
    next();
  }
  std::string expect_name() {
    if (peek().type != Tok::Name) syntax("expected a name, found '" + peek().text + "'");
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != Tok::BlockEnd) syntax("expected the end of the block tag, found '" + peek().text + "'");
    next();
  }

  // Statements up to one of `ends` (a block tag whose first word is in it; that word is returned in `end`, the tag
  // is consumed up to its name).
  std::vector<Stmt> parse_body(const std::set<std::string>& ends, std::string& end) {
    Nest nest(*this);
    std::vector<Stmt> out;
    while (true) {
      const Token& tk = peek();
      if (tk.type == Tok::End) {
        if (!ends.empty()) syntax("the template ended inside a block (expected " + *ends.begin() + ")");
        return out;
      }
      if (tk.type == Tok::Data) {
        Stmt s = make_stmt(Stmt::Text, tk.line);
        s.text = tk.text;
        out.push_back(std::move(s));
        next();
      } else if (tk.type == Tok::VarBegin) {
        next();
        Stmt s = make_stmt(Stmt::Print, tk.line);
        s.exprs.push_back(parse_tuple_or_expr());
        if (peek().type != Tok::VarEnd) syntax("expected '}}', found '" + peek().text + "'");
        next();
        out.push_back(std::move(s));
      } else if (tk.type == Tok::BlockBegin) {
        next();
        const int line = peek().line;
        const std::string word = expect_name();
        if (ends.count(word)) {
          end = word;
          return out;
        }
        out.push_back(parse_statement(word, line));
      } else {
        syntax("unexpected '" + tk.text + "'");
      }
    }
  }

  Stmt parse_statement(const std::string& word, int line) {
    if (word == "if") {
      Stmt s = make_stmt(Stmt::If, line);
      s.exprs.push_back(parse_expr());
      expect_block_end();
      while (true) {
        std::string end;
        s.bodies.push_back(parse_body({"elif", "else", "endif"}, end));
        if (end == "elif") {
          s.exprs.push_back(parse_expr());
          expect_block_end();
        } else if (end == "else") {
          expect_block_end();
          std::string e2;
          s.bodies.push_back(parse_body({"endif"}, e2));
          expect_block_end();
          break;
        } else {
          expect_block_end();
          break;
        }
      }
      return s;
    }
    if (word == "for") {
      Stmt s = make_stmt(Stmt::For, line);
      s.targets.push_back(expect_name());
      while (is_op(",")) {
        next();
        s.targets.push_back(expect_name());
      }
      if (!is_name("in")) syntax("expected 'in' in the for tag");
      next();
      s.exprs.push_back(parse_tuple_or_expr(/*condexpr=*/false));
      if (is_name("if")) {
        next();
        s.exprs.push_back(parse_expr());
      }
      if (is_name("recursive")) not_implemented(origin_, line, "the recursive for loop");
      expect_block_end();
      std::string end;
      s.bodies.push_back(parse_body({"else", "endfor"}, end));
      if (end == "else") {
        expect_block_end();
        std::string e2;
        s.bodies.push_back(parse_body({"endfor"}, e2));
      }
      expect_block_end();
      return s;
    }
    if (word == "set") {
      const std::string name = expect_name();
      if (is_op(".")) {
        next();
        Stmt s = make_stmt(Stmt::SetAttr, line);
        s.text = name;
        s.attr = expect_name();
        expect_op("=");
        s.exprs.push_back(parse_tuple_or_expr());
        expect_block_end();
        return s;
      }
      if (is_op(",")) not_implemented(origin_, line, "'set' with several targets");
      if (peek().type == Tok::BlockEnd)
        not_implemented(origin_, line, "the block form of 'set' ({% set x %}...{% endset %})");
      expect_op("=");
      Stmt s = make_stmt(Stmt::Set, line);
      s.text = name;
      s.exprs.push_back(parse_tuple_or_expr());
      expect_block_end();
      return s;
    }
    if (word == "macro") {
      Stmt s = make_stmt(Stmt::Macro, line);
      s.text = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        s.params.push_back(expect_name());
        if (is_op("=")) {
          next();
          s.defaults.push_back(parse_expr());
        } else {
          s.defaults.push_back(nullptr);
        }
        if (!is_op(")")) expect_op(",");
      }
      next();
      expect_block_end();
      std::string end;
      s.bodies.push_back(parse_body({"endmacro"}, end));
      if (peek().type == Tok::Name) next();  // {% endmacro name %}
      expect_block_end();
      return s;
    }
    if (word == "break" || word == "continue") {
      expect_block_end();
      return make_stmt(word == "break" ? Stmt::Break : Stmt::Continue, line);
    }
    if (word == "generation") {  // transformers' AssistantTracker extension: renders its body
      expect_block_end();
      Stmt s = make_stmt(Stmt::Generation, line);
      std::string end;
      s.bodies.push_back(parse_body({"endgeneration"}, end));
      expect_block_end();
      return s;
    }
    static const std::set<std::string> known = {"raw",   "call", "filter",     "include", "import", "from", "extends",
                                                "block", "with", "autoescape", "do",      "trans",  "print"};
    if (known.count(word)) not_implemented(origin_, line, "the '" + word + "' tag");
    not_implemented(origin_, line, "the block tag '" + word + "'");
  }

  // Expressions, following jinja2's parser precedence.
  ExprPtr make(Expr::Kind k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  ExprPtr parse_tuple_or_expr(bool condexpr = true) {
    const int line = peek().line;
    auto first = condexpr ? parse_expr() : parse_or();
    if (!is_op(",")) return first;
    auto t = make(Expr::TupleLit, line);
    t->kids.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (peek().type == Tok::BlockEnd || peek().type == Tok::VarEnd || is_name("if")) break;
      t->kids.push_back(condexpr ? parse_expr() : parse_or());
    }
    return t;
  }

  ExprPtr parse_expr() {
    auto e = parse_or();
    while (is_name("if")) {
      const int line = peek().line;
      next();
      auto c = make(Expr::Cond, line);
      auto cond = parse_or();
      ExprPtr other;
      if (is_name("else")) {
        next();
        other = parse_expr();
        c->has_else = true;
      }
      c->kids.push_back(std::move(cond));
      c->kids.push_back(std::move(e));
      if (other) c->kids.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr parse_or() {
    auto e = parse_and();
    while (is_name("or")) {
      auto o = make(Expr::Or, next().line);
      o->kids.push_back(std::move(e));
      o->kids.push_back(parse_and());
      e = std::move(o);
    }
    return e;
  }
  ExprPtr parse_and() {
    auto e = parse_not();
    while (is_name("and")) {
      auto o = make(Expr::And, next().line);
      o->kids.push_back(std::move(e));
      o->kids.push_back(parse_not());
      e = std::move(o);
    }
    return e;
  }
  ExprPtr parse_not() {
    Nest nest(*this);
    if (is_name("not")) {
      auto o = make(Expr::Not, next().line);
      o->kids.push_back(parse_not());
      return o;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    const int line = peek().line;
    auto first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (peek().type == Tok::Op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                     peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Compare, line);
        cmp->kids.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->kids.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  ExprPtr binary(ExprPtr l, const std::string& op, ExprPtr r, int line) {
    auto b = make(op == "~" ? Expr::Concat : Expr::Binary, line);
    b->name = op;
    b->kids.push_back(std::move(l));
    b->kids.push_back(std::move(r));
    return b;
  }
  ExprPtr parse_math1() {
    auto e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& op = next();
      e = binary(std::move(e), op.text, parse_concat(), op.line);
    }
    return e;
  }
  ExprPtr parse_concat() {
    auto e = parse_math2();
    while (is_op("~")) {
      const Token& op = next();
      e = binary(std::move(e), "~", parse_math2(), op.line);
    }
    return e;
  }
  ExprPtr parse_math2() {
    auto e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& op = next();
      e = binary(std::move(e), op.text, parse_pow(), op.line);
    }
    return e;
  }
  ExprPtr parse_pow() {
    auto e = parse_unary();
    while (is_op("**")) {
      const Token& op = next();
      e = binary(std::move(e), "**", parse_unary(), op.line);
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter = true) {
    Nest nest(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& op = next();
      e = make(op.text == "-" ? Expr::Neg : Expr::Pos, op.line);
      e->kids.push_back(parse_unary(false));
    } else {
      e = parse_postfix(parse_primary());
    }
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }
  ExprPtr parse_primary() {
    const Token& tk = peek();
    if (tk.type == Tok::Name) {
      next();
      static const std::map<std::string, int> consts = {{"true", 1},  {"True", 1},  {"false", 0},
                                                        {"False", 0}, {"none", -1}, {"None", -1}};
      if (auto it = consts.find(tk.text); it != consts.end()) {
        auto c = make(Expr::Const, tk.line);
        c->constant = it->second < 0 ? Value::none() : Value::boolean(it->second == 1);
        return c;
      }
      // Names jinja2 gives a meaning this interpreter does not: refused rather than read as undefined.
      if (tk.text == "varargs" || tk.text == "kwargs" || tk.text == "caller" || tk.text == "self")
        not_implemented(origin_, tk.line, "the special variable '" + tk.text + "'");
      auto n = make(Expr::Name, tk.line);
      n->name = tk.text;
      return n;
    }
    if (tk.type == Tok::String) {
      std::string s = next().text;
      while (peek().type == Tok::String) s += next().text;  // adjacent literals join
      auto c = make(Expr::Const, tk.line);
      c->constant = Value::string(s);
      return c;
    }
    if (tk.type == Tok::Int || tk.type == Tok::Float) {
      next();
      auto c = make(Expr::Const, tk.line);
      c->constant = tk.type == Tok::Int ? Value::integer(tk.i) : Value::number(tk.f);
      return c;
    }
    if (is_op("(")) {
      next();
      if (is_op(")")) {
        next();
        return make(Expr::TupleLit, tk.line);
      }
      auto e = parse_tuple_or_expr();
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto l = make(Expr::ListLit, tk.line);
      while (!is_op("]")) {
        l->kids.push_back(parse_expr());
        if (!is_op("]")) expect_op(",");
      }
      next();
      return l;
    }
    if (is_op("{")) {
      next();
      auto d = make(Expr::DictLit, tk.line);
      while (!is_op("}")) {
        d->kids.push_back(parse_expr());
        expect_op(":");
        d->kids.push_back(parse_expr());
        if (!is_op("}")) expect_op(",");
      }
      next();
      return d;
    }
    syntax("unexpected '" + tk.text + "'");
  }
  void parse_call_args(Expr& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) not_implemented(origin_, peek().line, "'*args' / '**kwargs' in a call");
      if (peek().type == Tok::Name && is_op("=", 1)) {
        call.kwnames.push_back(next().text);
        next();
        call.kids.push_back(parse_expr());
      } else {
        if (!call.kwnames.empty()) syntax("a positional argument after a keyword argument");
        call.kids.push_back(parse_expr());
      }
      if (!is_op(")")) expect_op(",");
    }
    next();
  }
  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        const int line = next().line;
        auto g = make(Expr::GetAttr, line);
        if (peek().type == Tok::Int) {  // foo.0 is foo[0]
          auto key = make(Expr::Const, line);
          key->constant = Value::integer(next().i);
          g->kind = Expr::GetItem;
          g->kids.push_back(std::move(e));
          g->kids.push_back(std::move(key));
        } else {
          g->name = expect_name();
          if (g->name == "cycle" || g->name == "changed") {
            if (e->kind == Expr::Name && e->name == "loop") not_implemented(origin_, line, "loop." + g->name + "()");
          }
          g->kids.push_back(std::move(e));
        }
        e = std::move(g);
      } else if (is_op("[")) {
        const int line = next().line;
        ExprPtr parts[3];
        bool slice = false;
        int part = 0;
        while (!is_op("]")) {
          if (is_op(":")) {
            next();
            slice = true;
            if (++part > 2) syntax("a slice with more than three parts");
            continue;
          }
          parts[part] = parse_expr();
        }
        next();
        if (slice) {
          auto s = make(Expr::Slice, line);
          s->kids.push_back(std::move(e));
          for (auto& x : parts) s->kids.push_back(std::move(x));
          e = std::move(s);
        } else {
          if (!parts[0]) syntax("an empty subscript");
          auto g = make(Expr::GetItem, line);
          g->kids.push_back(std::move(e));
          g->kids.push_back(std::move(parts[0]));
          e = std::move(g);
        }
      } else if (is_op("(")) {
        auto c = make(Expr::Call, peek().line);
        c->kids.push_back(std::move(e));
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        const int line = next().line;
        auto f = make(Expr::Filter, line);
        f->name = expect_name();
        if (!kFilters.count(f->name)) not_implemented(origin_, line, "the filter '" + f->name + "'");
        f->kids.push_back(std::move(e));
        if (is_op("(")) parse_call_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        const int line = next().line;
        auto t = make(Expr::Test, line);
        if (is_name("not")) {
          next();
          t->negate = true;
        }
        if (peek().type == Tok::Op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                       peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
          t->name = next().text;
        } else {
          t->name = expect_name();
        }
        if (!kTests.count(t->name)) not_implemented(origin_, line, "the test '" + t->name + "'");
        t->kids.push_back(std::move(e));
        if (is_op("(")) {
          parse_call_args(*t);
        } else if ((peek().type == Tok::Name || peek().type == Tok::String || peek().type == Tok::Int ||
                    peek().type == Tok::Float || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") && !is_name("in") &&
                   !is_name("not") && !is_name("is")) {
          t->kids.push_back(parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        auto c = make(Expr::Call, peek().line);
        c->kids.push_back(std::move(e));
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
};

}  // namespace

std::shared_ptr<const Program> parse_template(const std::string& source, const std::string& origin) {
  auto prog = std::make_shared<Program>();
  prog->origin = origin;
  Parser parser(lex(normalise_newlines(source), origin), origin);
  prog->body = parser.parse_all();
  return prog;
}

// ---------------------------------------------------------------------------------------------------------------
// Evaluation.
namespace {

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
  const Value* find(const std::string& n) const {
    for (const Scope* s = this; s; s = s->parent.get())
      if (auto it = s->vars.find(n); it != s->vars.end()) return &it->second;
    return nullptr;
  }
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { Normal, Break, Continue };

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

[[noreturn]] void undefined_error(const Value& v) {
  fail(v.s.empty() ? std::string("an undefined value was used") : v.s + " is undefined");
}

int64_t to_int(const Value& v, const char* what) {
  if (v.kind == Value::Kind::Int) return v.i;
  if (v.kind == Value::Kind::Bool) return v.b;
  fail(std::string(what) + " must be an integer, not " + v.type_name());
}

const std::string& need_str(const Value& v, const char* what) {
  if (!v.is_string()) fail(std::string(what) + " must be a string, not " + v.type_name());
  return v.s;
}

// Python's slice.indices(len) and the positions it selects.
std::vector<int64_t> slice_positions(int64_t n, const Value& a, const Value& b, const Value& c) {
  const int64_t step = c.is_none() || c.is_undefined() ? 1 : to_int(c, "a slice step");
  if (step == 0) fail("slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t dflt) {
    if (v.is_none() || v.is_undefined()) return dflt;
    int64_t x = to_int(v, "a slice index");
    if (x < 0) x += n;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t start = clamp(a, step > 0 ? 0 : n - 1), stop = clamp(b, step > 0 ? n : -1);
  std::vector<int64_t> out;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(k);
  return out;
}

// Python's str.strip / lstrip / rstrip with optional characters.
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  auto cps = utf8_decode(s);
  std::vector<uint32_t> set;
  const bool by_space = chars.is_none() || chars.is_undefined();
  if (!by_space) set = utf8_decode(need_str(chars, "strip()'s argument"));
  auto strip_it = [&](uint32_t cp) {
    return by_space ? python_isspace(cp) : std::find(set.begin(), set.end(), cp) != set.end();
  };
  size_t a = 0, b = cps.size();
  if (left)
    while (a < b && strip_it(cps[a])) ++a;
  if (right)
    while (b > a && strip_it(cps[b - 1])) --b;
  return utf8_encode(std::vector<uint32_t>(cps.begin() + static_cast<long>(a), cps.begin() + static_cast<long>(b)));
}

Value py_split(const std::string& s, const Value& sep, int64_t maxsplit) {
  List out;
  if (sep.is_none() || sep.is_undefined()) {
    const auto cps = utf8_decode(s);
    size_t k = 0;
    while (true) {
      while (k < cps.size() && python_isspace(cps[k])) ++k;
      if (k >= cps.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        size_t e = cps.size();
        while (e > k && python_isspace(cps[e - 1])) --e;
        out.push_back(
            Value::string(utf8_encode({cps.begin() + static_cast<long>(k), cps.begin() + static_cast<long>(e)})));
        break;
      }
      size_t e = k;
      while (e < cps.size() && !python_isspace(cps[e])) ++e;
      out.push_back(
          Value::string(utf8_encode({cps.begin() + static_cast<long>(k), cps.begin() + static_cast<long>(e)})));
      k = e;
    }
    return Value::make_list(std::move(out));
  }
  const std::string& d = need_str(sep, "split()'s separator");
  if (d.empty()) fail("empty separator");
  size_t pos = 0;
  while (true) {
    const size_t f = s.find(d, pos);
    if (f == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit)) {
      out.push_back(Value::string(s.substr(pos)));
      break;
    }
    out.push_back(Value::string(s.substr(pos, f - pos)));
    pos = f + d.size();
  }
  return Value::make_list(std::move(out));
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& rep, int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts `rep` between code points and at both ends
    const auto cps = utf8_decode(s);
    int64_t done = 0;
    for (size_t k = 0; k <= cps.size(); ++k) {
      if (count < 0 || done < count) out += rep, ++done;
      if (k < cps.size()) out += utf8_encode({cps[k]});
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (true) {
    const size_t f = s.find(old, pos);
    if (f == std::string::npos || (count >= 0 && done >= count)) break;
    out += s.substr(pos, f - pos) + rep;
    pos = f + old.size();
    ++done;
  }
  return out + s.substr(pos);
}

std::string ascii_case(const std::string& s, bool upper, const char* method) {
  std::string out = s;
  for (char& c : out) {
    if (static_cast<unsigned char>(c) >= 0x80)
      not_implemented("", 0, std::string("str.") + method + "() of non-ASCII text");
    c = static_cast<char>(upper ? std::toupper(static_cast<unsigned char>(c))
                                : std::tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

Value arg(Args& a, Kwargs& kw, size_t pos, const char* name, Value dflt = Value::none()) {
  if (pos < a.size()) return a[pos];
  for (auto& [k, v] : kw)
    if (k == name) return v;
  return dflt;
}

void check_arity(const char* fn, Args& a, Kwargs& kw, size_t max_pos, std::initializer_list<const char*> names) {
  if (a.size() > max_pos) fail(std::string(fn) + " takes at most " + std::to_string(max_pos) + " positional arguments");
  for (auto& [k, v] : kw)
    if (std::find_if(names.begin(), names.end(), [&](const char* n) { return k == n; }) == names.end())
      fail(std::string(fn) + " got an unexpected keyword argument '" + k + "'");
}

const std::set<std::string> kStrMethods = {
    "capitalize",   "casefold",   "center",    "count",       "encode",    "endswith",     "expandtabs",   "find",
    "format",       "format_map", "index",     "isalnum",     "isalpha",   "isascii",      "isdecimal",    "isdigit",
    "isidentifier", "islower",    "isnumeric", "isprintable", "isspace",   "istitle",      "isupper",      "join",
    "ljust",        "lower",      "lstrip",    "maketrans",   "partition", "removeprefix", "removesuffix", "replace",
    "rfind",        "rindex",     "rjust",     "rpartition",  "rsplit",    "rstrip",       "split",        "splitlines",
    "startswith",   "strip",      "swapcase",  "title",       "translate", "upper",        "zfill"};
const std::set<std::string> kDictMethods = {"clear", "copy",    "fromkeys",   "get",    "items", "keys",
                                            "pop",   "popitem", "setdefault", "update", "values"};
const std::set<std::string> kListMethods = {"append", "clear", "copy",   "count",   "extend", "index",
                                            "insert", "pop",   "remove", "reverse", "sort"};

Value str_method(const Value& self, const std::string& m) {
  const std::string s = self.s;
  auto fn = [&](auto f) { return Value::callable(f); };
  if (m == "startswith" || m == "endswith") {
    const bool start = m == "startswith";
    return fn([s, start](Args& a, Kwargs& kw) {
      check_arity(start ? "startswith" : "endswith", a, kw, 1, {});
      if (a.empty()) fail("startswith/endswith needs an argument");
      auto test = [&](const std::string& x) {
        return x.size() <= s.size() &&
               (start ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0);
      };
      if (a[0].is_list()) {
        for (const Value& x : *a[0].list)
          if (test(need_str(x, "a prefix"))) return Value::boolean(true);
        return Value::boolean(false);
      }
      return Value::boolean(test(need_str(a[0], "a prefix")));
    });
  }
  if (m == "strip" || m == "lstrip" || m == "rstrip") {
    const bool l = m != "rstrip", r = m != "lstrip";
    return fn([s, l, r](Args& a, Kwargs& kw) {
      check_arity("strip", a, kw, 1, {});
      return Value::string(py_strip(s, arg(a, kw, 0, ""), l, r));
    });
  }
  if (m == "split")
    return fn([s](Args& a, Kwargs& kw) {
      check_arity("split", a, kw, 2, {"sep", "maxsplit"});
      return py_split(s, arg(a, kw, 0, "sep"), to_int(arg(a, kw, 1, "maxsplit", Value::integer(-1)), "maxsplit"));
    });
  if (m == "replace")
    return fn([s](Args& a, Kwargs& kw) {
      check_arity("replace", a, kw, 3, {"count"});
      if (a.size() < 2) fail("replace() takes at least 2 arguments");
      return Value::string(py_replace(s, need_str(a[0], "replace()'s old"), need_str(a[1], "replace()'s new"),
                                      to_int(arg(a, kw, 2, "count", Value::integer(-1)), "count")));
    });
  if (m == "lower" || m == "upper") {
    const bool up = m == "upper";
    return fn([s, up](Args& a, Kwargs& kw) {
      check_arity(up ? "upper" : "lower", a, kw, 0, {});
      return Value::string(ascii_case(s, up, up ? "upper" : "lower"));
    });
  }
  if (m == "find")
    return fn([s](Args& a, Kwargs& kw) {
      check_arity("find", a, kw, 1, {});
      if (a.empty()) fail("find() takes an argument");
      const size_t f = s.find(need_str(a[0], "find()'s argument"));
      if (f == std::string::npos) return Value::integer(-1);
      return Value::integer(static_cast<int64_t>(utf8_decode(std::string_view(s).substr(0, f)).size()));
    });
  not_implemented("", 0, "the string method '" + m + "'");
}

Value dict_method(const Value& self, const std::string& m) {
  auto d = self.dict;
  if (m == "items" || m == "keys" || m == "values") {
    const int which = m == "items" ? 0 : m == "keys" ? 1 : 2;
    return Value::callable([d, which](Args& a, Kwargs& kw) {
      check_arity("items/keys/values", a, kw, 0, {});
      List out;
      for (const auto& [k, v] : d->items)
        out.push_back(which == 0 ? Value::make_list({Value::string(k), v}, true) : which == 1 ? Value::string(k) : v);
      return Value::make_list(std::move(out));
    });
  }
  if (m == "get")
    return Value::callable([d](Args& a, Kwargs& kw) {
      check_arity("get", a, kw, 2, {});
      if (a.empty()) fail("get() takes at least 1 argument");
      if (!a[0].is_string()) return a.size() > 1 ? a[1] : Value::none();
      const Value* v = d->find(a[0].s);
      return v ? *v : a.size() > 1 ? a[1] : Value::none();
    });
  not_implemented("", 0, "the dict method '" + m + "'");
}

// jinja2's environment.getattr(obj, name): a Python attribute first (methods), then the item.
Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Value::Kind::Undefined:
      undefined_error(obj);
    case Value::Kind::String:
      if (kStrMethods.count(name)) return str_method(obj, name);
      break;
    case Value::Kind::Map: {
      if (kDictMethods.count(name)) return dict_method(obj, name);
      if (const Value* v = obj.dict->find(name)) return *v;
      break;
    }
    case Value::Kind::Namespace:
      if (const Value* v = obj.dict->find(name)) return *v;
      break;
    case Value::Kind::Array:
      if (kListMethods.count(name)) not_implemented("", 0, "the list method '" + name + "'");
      break;
    default:
      break;
  }
  return Value::undefined("'" + obj.type_name() + " object' has no attribute '" + name + "'; it");
}

// jinja2's environment.getitem(obj, key): the item first, then (for a string key) the attribute.
Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) undefined_error(obj);
  if (obj.is_dict() && key.is_string()) {
    if (const Value* v = obj.dict->find(key.s)) return *v;
    return get_attr(obj, key.s);
  }
  if ((obj.is_list() || obj.is_string()) && (key.kind == Value::Kind::Int || key.kind == Value::Kind::Bool)) {
    int64_t k = to_int(key, "an index");
    if (obj.is_list()) {
      const int64_t n = static_cast<int64_t>(obj.list->size());
      if (k < 0) k += n;
      if (k >= 0 && k < n) return (*obj.list)[static_cast<size_t>(k)];
    } else {
      const auto cps = utf8_decode(obj.s);
      const int64_t n = static_cast<int64_t>(cps.size());
      if (k < 0) k += n;
      if (k >= 0 && k < n) return Value::string(utf8_encode({cps[static_cast<size_t>(k)]}));
    }
    return Value::undefined("index " + key.str() + " of a " + obj.type_name() + " of length " +
                            std::to_string(obj.is_list() ? obj.list->size() : utf8_decode(obj.s).size()) + "; it");
  }
  if (key.is_string()) return get_attr(obj, key.s);
  return Value::undefined("'" + obj.type_name() + " object' has no item " + key.repr() + "; it");
}

List iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
      return {};
    case Value::Kind::Array:
      return *v.list;
    case Value::Kind::Map: {
      List out;
      for (const auto& [k, x] : v.dict->items) out.push_back(Value::string(k));
      return out;
    }
    case Value::Kind::String: {
      List out;
      for (uint32_t cp : utf8_decode(v.s)) out.push_back(Value::string(utf8_encode({cp})));
      return out;
    }
    default:
      fail("'" + v.type_name() + "' object is not iterable");
  }
}

int64_t py_length(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
      return 0;
    case Value::Kind::String:
      return static_cast<int64_t>(utf8_decode(v.s).size());
    case Value::Kind::Array:
      return static_cast<int64_t>(v.list->size());
    case Value::Kind::Map:
      return static_cast<int64_t>(v.dict->items.size());
    default:
      fail("object of type '" + v.type_name() + "' has no len()");
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Value::Kind::Undefined:
      return false;
    case Value::Kind::String:
      if (!item.is_string()) fail("'in <string>' requires string as left operand, not " + item.type_name());
      return container.s.find(item.s) != std::string::npos;
    case Value::Kind::Array:
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& x) { return equal(x, item); });
    case Value::Kind::Map:
      return item.is_string() && container.dict->find(item.s) != nullptr;
    default:
      fail("argument of type '" + container.type_name() + "' is not iterable");
  }
}

bool less(const Value& a, const Value& b, const std::string& op) {
  if (a.is_number() && b.is_number()) {
    if (a.kind != Value::Kind::Float && b.kind != Value::Kind::Float) return to_int(a, "") < to_int(b, "");
    auto d = [](const Value& v) { return v.kind == Value::Kind::Float ? v.f : static_cast<double>(to_int(v, "")); };
    return d(a) < d(b);
  }
  if (a.is_string() && b.is_string()) return a.s < b.s;  // UTF-8 byte order is code point order
  fail("'" + op + "' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'");
}

bool compare(const Value& a, const std::string& op, const Value& b) {
  if (op == "==") return equal(a, b);
  if (op == "!=") return !equal(a, b);
  if (op == "in") return contains(b, a);
  if (op == "not in") return !contains(b, a);
  if (op == "<") return less(a, b, op);
  if (op == ">") return less(b, a, op);
  if (op == "<=") return !less(b, a, op);
  return !less(a, b, op);  // >=
}

[[noreturn]] Value overflow() { not_implemented("", 0, "integer arithmetic beyond 64 bits"); }

Value arithmetic(const Value& a, const std::string& op, const Value& b) {
  if (a.is_undefined()) undefined_error(a);
  if (b.is_undefined()) undefined_error(b);
  if (a.is_number() && b.is_number()) {
    const bool floats = a.kind == Value::Kind::Float || b.kind == Value::Kind::Float;
    auto d = [](const Value& v) { return v.kind == Value::Kind::Float ? v.f : static_cast<double>(to_int(v, "")); };
    if (op == "/") {
      if (d(b) == 0) fail("division by zero");
      return Value::number(d(a) / d(b));
    }
    if (op == "**") {
      if (!floats && to_int(b, "") >= 0) {
        int64_t r = 1, base = to_int(a, "");
        for (int64_t e = to_int(b, ""); e > 0; e >>= 1) {  // by squaring
          if ((e & 1) && __builtin_mul_overflow(r, base, &r)) overflow();
          if (e > 1 && __builtin_mul_overflow(base, base, &base)) overflow();
        }
        return Value::integer(r);
      }
      return Value::number(std::pow(d(a), d(b)));
    }
    if (!floats) {
      const int64_t x = to_int(a, ""), y = to_int(b, "");
      int64_t r = 0;
      if (op == "+") return __builtin_add_overflow(x, y, &r) ? overflow() : Value::integer(r);
      if (op == "-") return __builtin_sub_overflow(x, y, &r) ? overflow() : Value::integer(r);
      if (op == "*") return __builtin_mul_overflow(x, y, &r) ? overflow() : Value::integer(r);
      if (y == 0) fail("integer division or modulo by zero");
      if (x == INT64_MIN && y == -1) overflow();
      const int64_t q = x / y - ((x % y != 0) && ((x < 0) != (y < 0)) ? 1 : 0);  // floor, as Python
      return Value::integer(op == "//" ? q : x - q * y);
    }
    const double x = d(a), y = d(b);
    if (op == "+") return Value::number(x + y);
    if (op == "-") return Value::number(x - y);
    if (op == "*") return Value::number(x * y);
    if (y == 0) fail("float division by zero");
    const double q = std::floor(x / y);
    return Value::number(op == "//" ? q : x - q * y);
  }
  if (op == "+" && a.is_string() && b.is_string()) {
    if (a.markup == b.markup) return Value::string(a.s + b.s, a.markup);
    return Value::string((a.markup ? a.s : html_escape(a.s)) + (b.markup ? b.s : html_escape(b.s)), true);
  }
  if (op == "+" && a.is_list() && b.is_list()) {
    List l = *a.list;
    l.insert(l.end(), b.list->begin(), b.list->end());
    return Value::make_list(std::move(l), a.tuple);
  }
  if (op == "*" && (a.is_string() || a.is_list()) && (b.kind == Value::Kind::Int || b.kind == Value::Kind::Bool)) {
    const int64_t n = to_int(b, "");
    const size_t unit = a.is_string() ? a.s.size() : a.list->size();
    if (n > 0 && unit > 0 && static_cast<uint64_t>(n) > (uint64_t{1} << 26) / unit)
      not_implemented("", 0, "a repetition longer than 2^26 items");
    if (a.is_string()) {
      std::string s;
      for (int64_t k = 0; k < n; ++k) s += a.s;
      return Value::string(s, a.markup);
    }
    List l;
    for (int64_t k = 0; k < n; ++k) l.insert(l.end(), a.list->begin(), a.list->end());
    return Value::make_list(std::move(l), a.tuple);
  }
  if (op == "%" && a.is_string()) not_implemented("", 0, "string formatting with '%'");
  fail("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" + b.type_name() + "'");
}

class Renderer {
 public:
  explicit Renderer(const Program& prog) : prog_(prog) {}

  std::string run(const Dict& variables) {
    auto globals = std::make_shared<Scope>();
    add_globals(*globals);
    auto root = std::make_shared<Scope>();
    root->parent = globals;
    for (const auto& [k, v] : variables.items) root->vars[k] = v;
    std::string out;
    exec_body(prog_.body, root, out);
    return out;
  }

 private:
  const Program& prog_;
  int line_ = 0;   // the line of the statement running, for errors raised below it
  int calls_ = 0;  // macros running: bounded, as Python's recursion limit bounds jinja2's

  [[noreturn]] void raise(const std::string& msg) const { throw TemplateError(where(prog_.origin, line_) + msg); }

  static void add_globals(Scope& g) {
    g.vars["raise_exception"] = Value::callable([](Args& a, Kwargs&) -> Value {
      fail("the chat template raised an error: " + (a.empty() ? std::string() : a[0].str()));
    });
    g.vars["strftime_now"] = Value::callable([](Args& a, Kwargs&) {
      if (a.empty()) fail("strftime_now() takes a format");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[512];
      const size_t n = std::strftime(buf, sizeof buf, need_str(a[0], "the format").c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
    auto make_ns = [](Args& a, Kwargs& kw, bool check) {
      Dict d;
      if (a.size() > 1) fail("expected at most 1 positional argument");
      if (!a.empty()) {
        if (!a[0].is_dict()) fail("namespace()/dict() takes a mapping");
        d = *a[0].dict;
      }
      for (auto& [k, v] : kw) d.set(k, v);
      if (check)
        for (auto& [k, v] : d.items)
          if (!k.empty() && k[0] == '_')
            fail("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + k + "'");
      return d;
    };
    g.vars["namespace"] =
        Value::callable([make_ns](Args& a, Kwargs& kw) { return Value::make_namespace(make_ns(a, kw, true)); });
    g.vars["dict"] =
        Value::callable([make_ns](Args& a, Kwargs& kw) { return Value::make_dict(make_ns(a, kw, false)); });
    g.vars["range"] = Value::callable([](Args& a, Kwargs& kw) {
      check_arity("range", a, kw, 3, {});
      if (a.empty()) fail("range expected at least 1 argument");
      int64_t start = 0, stop, step = 1;
      if (a.size() == 1) {
        stop = to_int(a[0], "range()'s argument");
      } else {
        start = to_int(a[0], "range()'s argument");
        stop = to_int(a[1], "range()'s argument");
        if (a.size() == 3) step = to_int(a[2], "range()'s step");
      }
      if (step == 0) fail("range() arg 3 must not be zero");
      List l;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
        if (l.size() >= 100000) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        l.push_back(Value::integer(k));
      }
      return Value::make_list(std::move(l));
    });
  }

  Flow exec_body(const std::vector<Stmt>& body, const ScopePtr& scope, std::string& out) {
    for (const Stmt& s : body) {
      const Flow f = exec(s, scope, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Flow exec(const Stmt& s, const ScopePtr& scope, std::string& out) {
    if (s.kind == Stmt::Text) {
      out += s.text;
      return Flow::Normal;
    }
    const int saved = line_;
    line_ = s.line;
    try {
      const Flow f = exec_inner(s, scope, out);
      line_ = saved;
      return f;
    } catch (const EvalError& e) {
      raise(e.what());
    } catch (const TemplateError& e) {
      // Refusals raised below without a line (methods, operators) get this one.
      const std::string msg = e.what();
      if (msg.rfind(", line ", 0) == 0) raise(msg.substr(std::string(", line 0: ").size()));
      throw;
    }
  }

  Flow exec_inner(const Stmt& s, const ScopePtr& scope, std::string& out) {
    switch (s.kind) {
      case Stmt::Text:
        out += s.text;
        return Flow::Normal;
      case Stmt::Print:
        out += eval(*s.exprs[0], scope).str();
        return Flow::Normal;
      case Stmt::If:
        for (size_t k = 0; k < s.exprs.size(); ++k)
          if (eval(*s.exprs[k], scope).truthy()) return exec_body(s.bodies[k], scope, out);
        if (s.bodies.size() > s.exprs.size()) return exec_body(s.bodies.back(), scope, out);
        return Flow::Normal;
      case Stmt::For:
        return exec_for(s, scope, out);
      case Stmt::Set:
        scope->vars[s.text] = eval(*s.exprs[0], scope);
        return Flow::Normal;
      case Stmt::SetAttr: {
        const Value* ns = scope->find(s.text);
        if (!ns || ns->kind != Value::Kind::Namespace) fail("cannot assign attribute on non-namespace object");
        if (!s.attr.empty() && s.attr[0] == '_')
          fail("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + s.attr + "'");
        ns->dict->set(s.attr, eval(*s.exprs[0], scope));
        return Flow::Normal;
      }
      case Stmt::Macro:
        scope->vars[s.text] = make_macro(s, scope);
        return Flow::Normal;
      case Stmt::Break:
        return Flow::Break;
      case Stmt::Continue:
        return Flow::Continue;
      case Stmt::Generation:
        return exec_body(s.bodies[0], scope, out);
    }
    return Flow::Normal;
  }

  Flow exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
    List items = iterate(eval(*s.exprs[0], scope));
    if (s.exprs.size() > 1) {  // the loop filter: "for x in xs if cond"
      List kept;
      for (const Value& it : items) {
        auto fs = std::make_shared<Scope>();
        fs->parent = scope;
        bind_targets(s, it, *fs);
        if (eval(*s.exprs[1], fs).truthy()) kept.push_back(it);
      }
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      auto body_scope = std::make_shared<Scope>();
      body_scope->parent = scope;
      bind_targets(s, items[static_cast<size_t>(k)], *body_scope);
      Dict loop;
      loop.items = {{"index", Value::integer(k + 1)},
                    {"index0", Value::integer(k)},
                    {"revindex", Value::integer(n - k)},
                    {"revindex0", Value::integer(n - k - 1)},
                    {"first", Value::boolean(k == 0)},
                    {"last", Value::boolean(k == n - 1)},
                    {"length", Value::integer(n)},
                    {"depth", Value::integer(1)},
                    {"depth0", Value::integer(0)},
                    {"previtem", k > 0 ? items[static_cast<size_t>(k - 1)]
                                       : Value::undefined("there is no previous item: loop.previtem")},
                    {"nextitem", k + 1 < n ? items[static_cast<size_t>(k + 1)]
                                           : Value::undefined("there is no next item: loop.nextitem")}};
      body_scope->vars["loop"] = Value::make_dict(std::move(loop));
      if (exec_body(s.bodies[0], body_scope, out) == Flow::Break) break;
    }
    if (n == 0 && s.bodies.size() > 1) exec_body(s.bodies[1], scope, out);
    return Flow::Normal;
  }

  static void bind_targets(const Stmt& s, const Value& item, Scope& sc) {
    if (s.targets.size() == 1) {
      sc.vars[s.targets[0]] = item;
      return;
    }
    const List parts = iterate(item);
    if (parts.size() != s.targets.size())
      fail("cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(s.targets.size()) +
           " loop variables");
    for (size_t k = 0; k < parts.size(); ++k) sc.vars[s.targets[k]] = parts[k];
  }

  Value make_macro(const Stmt& m, const ScopePtr& defining) {
    const Stmt* def = &m;
    return Value::callable([this, def, defining](Args& a, Kwargs& kw) {
      if (a.size() > def->params.size())
        fail("macro '" + def->text + "' takes not more than " + std::to_string(def->params.size()) + " argument(s)");
      auto sc = std::make_shared<Scope>();
      sc->parent = defining;
      for (size_t k = 0; k < def->params.size(); ++k) {
        if (k < a.size()) {
          sc->vars[def->params[k]] = a[k];
          continue;
        }
        auto it = std::find_if(kw.begin(), kw.end(), [&](auto& p) { return p.first == def->params[k]; });
        if (it != kw.end())
          sc->vars[def->params[k]] = it->second;
        else if (def->defaults[k])
          sc->vars[def->params[k]] = eval(*def->defaults[k], sc);
        else
          sc->vars[def->params[k]] =
              Value::undefined("parameter '" + def->params[k] + "' of macro '" + def->text + "'");
      }
      for (auto& [k, v] : kw)
        if (std::find(def->params.begin(), def->params.end(), k) == def->params.end())
          fail("macro '" + def->text + "' takes no keyword argument '" + k + "'");
      std::string out;
      const int saved = line_;
      if (calls_ >= 200) fail("maximum recursion depth exceeded in macro '" + def->text + "'");
      ++calls_;
      try {
        exec_body(def->bodies[0], sc, out);
      } catch (...) {
        --calls_;
        throw;
      }
      --calls_;
      line_ = saved;
      return Value::string(out);
    });
  }

  void eval_args(const Expr& e, size_t first, const ScopePtr& scope, Args& a, Kwargs& kw) {
    const size_t nkw = e.kwnames.size(), npos = e.kids.size() - first - nkw;
    for (size_t k = 0; k < npos; ++k) a.push_back(eval(*e.kids[first + k], scope));
    for (size_t k = 0; k < nkw; ++k) kw.emplace_back(e.kwnames[k], eval(*e.kids[first + npos + k], scope));
  }

  Value eval(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case Expr::Const:
        return e.constant;
      case Expr::Name: {
        if (const Value* v = scope->find(e.name)) return *v;
        return Value::undefined("'" + e.name + "'");
      }
      case Expr::GetAttr:
        return get_attr(eval(*e.kids[0], scope), e.name);
      case Expr::GetItem:
        return get_item(eval(*e.kids[0], scope), eval(*e.kids[1], scope));
      case Expr::Slice: {
        const Value obj = eval(*e.kids[0], scope);
        Value parts[3];
        for (int k = 0; k < 3; ++k) parts[k] = e.kids[1 + k] ? eval(*e.kids[1 + k], scope) : Value::none();
        if (obj.is_undefined()) undefined_error(obj);
        if (obj.is_list()) {
          List l;
          for (int64_t k : slice_positions(static_cast<int64_t>(obj.list->size()), parts[0], parts[1], parts[2]))
            l.push_back((*obj.list)[static_cast<size_t>(k)]);
          return Value::make_list(std::move(l), obj.tuple);
        }
        if (obj.is_string()) {
          const auto cps = utf8_decode(obj.s);
          std::vector<uint32_t> r;
          for (int64_t k : slice_positions(static_cast<int64_t>(cps.size()), parts[0], parts[1], parts[2]))
            r.push_back(cps[static_cast<size_t>(k)]);
          return Value::string(utf8_encode(r), obj.markup);
        }
        return Value::undefined("a slice of a " + obj.type_name());
      }
      case Expr::Call: {
        const Value callee = eval(*e.kids[0], scope);
        Args a;
        Kwargs kw;
        eval_args(e, 1, scope, a, kw);
        if (callee.kind != Value::Kind::Callable) {
          if (callee.is_undefined()) {
            if (e.kids[0]->kind == Expr::Name)
              not_implemented("", 0,
                              "the function '" + e.kids[0]->name +
                                  "' (not a global of transformers' environment, nor defined here)");
            undefined_error(callee);
          }
          fail("'" + callee.type_name() + "' object is not callable");
        }
        return (*callee.fn)(a, kw);
      }
      case Expr::Filter:
        return filter(e, scope);
      case Expr::Test: {
        const Value v = eval(*e.kids[0], scope);
        Args a;
        Kwargs kw;
        eval_args(e, 1, scope, a, kw);
        return Value::boolean(test(e.name, v, a) != e.negate);
      }
      case Expr::Neg:
      case Expr::Pos: {
        const Value v = eval(*e.kids[0], scope);
        if (v.kind == Value::Kind::Float) return Value::number(e.kind == Expr::Neg ? -v.f : v.f);
        if (v.kind == Value::Kind::Int || v.kind == Value::Kind::Bool) {
          if (e.kind == Expr::Neg && to_int(v, "") == INT64_MIN) overflow();
          return Value::integer(e.kind == Expr::Neg ? -to_int(v, "") : to_int(v, ""));
        }
        if (v.is_undefined()) undefined_error(v);
        fail("bad operand type for unary " + std::string(e.kind == Expr::Neg ? "-" : "+") + ": '" + v.type_name() +
             "'");
      }
      case Expr::Not:
        return Value::boolean(!eval(*e.kids[0], scope).truthy());
      case Expr::And: {
        Value l = eval(*e.kids[0], scope);
        return l.truthy() ? eval(*e.kids[1], scope) : l;
      }
      case Expr::Or: {
        Value l = eval(*e.kids[0], scope);
        return l.truthy() ? l : eval(*e.kids[1], scope);
      }
      case Expr::Binary:
        return arithmetic(eval(*e.kids[0], scope), e.name, eval(*e.kids[1], scope));
      case Expr::Concat:
        return Value::string(eval(*e.kids[0], scope).str() + eval(*e.kids[1], scope).str());
      case Expr::Compare: {
        Value left = eval(*e.kids[0], scope);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.kids[k + 1], scope);
          if (!compare(left, e.ops[k], right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Cond:
        if (eval(*e.kids[0], scope).truthy()) return eval(*e.kids[1], scope);
        return e.has_else ? eval(*e.kids[2], scope) : Value::undefined("the value of an 'if' without 'else'");
      case Expr::ListLit:
      case Expr::TupleLit: {
        List l;
        for (const auto& k : e.kids) l.push_back(eval(*k, scope));
        return Value::make_list(std::move(l), e.kind == Expr::TupleLit);
      }
      case Expr::DictLit: {
        Dict d;
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          const Value key = eval(*e.kids[k], scope);
          if (!key.is_string()) not_implemented("", 0, "a dict literal with a key that is not a string");
          d.set(key.s, eval(*e.kids[k + 1], scope));
        }
        return Value::make_dict(std::move(d));
      }
    }
    fail("unknown expression");
  }

  bool test(const std::string& name, const Value& v, Args& a) {
    using K = Value::Kind;
    auto need = [&](size_t n) {
      if (a.size() < n) fail("the test '" + name + "' needs an argument");
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict();
    if (name == "iterable") return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
    if (name == "sequence") return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
    if (name == "number") return v.is_number();
    if (name == "integer") return v.kind == K::Int;
    if (name == "float") return v.kind == K::Float;
    if (name == "boolean") return v.kind == K::Bool;
    if (name == "true") return v.kind == K::Bool && v.b;
    if (name == "false") return v.kind == K::Bool && !v.b;
    if (name == "callable") return v.kind == K::Callable;
    if (name == "odd" || name == "even") {
      const int64_t x = to_int(v, "the value tested");
      return ((x % 2 + 2) % 2 == 1) == (name == "odd");
    }
    if (name == "divisibleby") {
      need(1);
      const int64_t d = to_int(a[0], "divisibleby's argument");
      if (d == 0) fail("integer division or modulo by zero");
      return to_int(v, "the value tested") % d == 0;
    }
    if (name == "lower" || name == "upper") {
      if (!v.is_string()) fail("the test '" + name + "' needs a string");
      for (char c : v.s) {
        if (static_cast<unsigned char>(c) >= 0x80) not_implemented("", 0, "the test '" + name + "' on non-ASCII text");
      }
      const std::string conv = ascii_case(v.s, name == "upper", name.c_str());
      return conv == v.s &&
             std::any_of(v.s.begin(), v.s.end(), [](char c) { return std::isalpha(static_cast<unsigned char>(c)); });
    }
    need(1);
    if (name == "sameas") {
      if (v.kind != a[0].kind) return false;
      if (v.kind == K::None || v.kind == K::Undefined) return true;
      if (v.kind == K::Bool) return v.b == a[0].b;
      if (v.kind == K::Array) return v.list == a[0].list;
      if (v.kind == K::Map || v.kind == K::Namespace) return v.dict == a[0].dict;
      not_implemented("", 0, "the test 'sameas' on a " + v.type_name());
    }
    if (name == "in") return contains(a[0], v);
    static const std::map<std::string, std::string> ops = {
        {"eq", "=="}, {"equalto", "=="}, {"==", "=="}, {"ne", "!="}, {"!=", "!="},
        {"lt", "<"},  {"lessthan", "<"}, {"<", "<"},   {"gt", ">"},  {"greaterthan", ">"},
        {">", ">"},   {"le", "<="},      {"<=", "<="}, {"ge", ">="}, {">=", ">="}};
    return compare(v, ops.at(name), a[0]);
  }

  Value filter(const Expr& e, const ScopePtr& scope) {
    const Value v = eval(*e.kids[0], scope);
    Args a;
    Kwargs kw;
    eval_args(e, 1, scope, a, kw);
    const std::string& f = e.name;
    if (f == "tojson") {
      check_arity("tojson", a, kw, 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
      const Value ensure = arg(a, kw, 0, "ensure_ascii", Value::boolean(false));
      const Value indent = arg(a, kw, 1, "indent");
      const Value seps = arg(a, kw, 2, "separators");
      const bool sort_keys = arg(a, kw, 3, "sort_keys", Value::boolean(false)).truthy();
      if (ensure.truthy()) not_implemented("", 0, "tojson(ensure_ascii=true)");
      int ind = -1;
      if (!indent.is_none()) {
        if (indent.kind != Value::Kind::Int) not_implemented("", 0, "tojson's indent other than an integer");
        ind = static_cast<int>(std::max<int64_t>(0, indent.i));
      }
      std::string item_sep = ind >= 0 ? "," : ", ", key_sep = ": ";
      if (!seps.is_none()) {
        if (!seps.is_list() || seps.list->size() != 2) fail("tojson's separators must be a pair of strings");
        item_sep = need_str((*seps.list)[0], "a separator");
        key_sep = need_str((*seps.list)[1], "a separator");
      }
      try {
        return Value::string(to_json(v, ind, item_sep, key_sep, sort_keys));
      } catch (const std::invalid_argument& x) {
        fail(x.what());
      }
    }
    if (f == "safe") return Value::string(v.str(), true);
    if (f == "e" || f == "escape") return Value::string(v.markup ? v.s : html_escape(v.str()), true);
    if (f == "string") return v.markup ? v : Value::string(v.str());
    if (f == "trim") {
      check_arity("trim", a, kw, 1, {"chars"});
      return Value::string(py_strip(v.str(), arg(a, kw, 0, "chars"), true, true));
    }
    if (f == "length" || f == "count") return Value::integer(py_length(v));
    if (f == "items") {
      if (v.is_undefined()) return Value::make_list({});
      if (!v.is_dict()) fail("Can only get item pairs from a mapping.");
      List out;
      for (const auto& [k, x] : v.dict->items) out.push_back(Value::make_list({Value::string(k), x}, true));
      return Value::make_list(std::move(out));
    }
    if (f == "default" || f == "d") {
      const Value dflt = arg(a, kw, 0, "default_value", Value::string(""));
      const bool boolean = arg(a, kw, 1, "boolean", Value::boolean(false)).truthy();
      return (v.is_undefined() || (boolean && !v.truthy())) ? dflt : v;
    }
    if (f == "join") {
      check_arity("join", a, kw, 1, {"d"});
      const Value sep = arg(a, kw, 0, "d", Value::string(""));
      std::string out;
      bool first = true;
      for (const Value& x : iterate(v)) {
        if (!first) out += sep.str();
        out += x.str();
        first = false;
      }
      return Value::string(out);
    }
    if (f == "first" || f == "last") {
      const List l = iterate(v);
      if (l.empty()) return Value::undefined("the " + f + " item of an empty sequence");
      return f == "first" ? l.front() : l.back();
    }
    if (f == "list") return Value::make_list(iterate(v));
    if (f == "lower" || f == "upper") return Value::string(ascii_case(v.str(), f == "upper", f.c_str()));
    if (f == "capitalize") {
      std::string s = ascii_case(v.str(), false, "capitalize");
      if (!s.empty()) s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
      return Value::string(s);
    }
    if (f == "replace") {
      if (a.size() < 2) fail("replace needs two arguments");
      return Value::string(py_replace(v.str(), a[0].str(), a[1].str(), a.size() > 2 ? to_int(a[2], "count") : -1));
    }
    if (f == "int") {
      if (v.kind == Value::Kind::Int || v.kind == Value::Kind::Bool) return Value::integer(to_int(v, ""));
      if (v.kind == Value::Kind::Float) return Value::integer(static_cast<int64_t>(v.f));
      not_implemented("", 0, "the filter 'int' on a " + v.type_name());
    }
    if (f == "float") {
      if (v.is_number()) return Value::number(v.kind == Value::Kind::Float ? v.f : static_cast<double>(to_int(v, "")));
      not_implemented("", 0, "the filter 'float' on a " + v.type_name());
    }
    if (f == "abs") {
      if (v.kind == Value::Kind::Float) return Value::number(std::fabs(v.f));
      const int64_t x = to_int(v, "abs()'s argument");
      if (x == INT64_MIN) overflow();
      return Value::integer(x < 0 ? -x : x);
    }
    not_implemented("", 0, "the filter '" + f + "'");
  }
};

}  // namespace

std::string render_template(const Program& program, const Dict& variables) {
  Renderer r(program);
  return r.run(variables);
}

}  // namespace hs::chat
