// A small interpreter of the Jinja subset that chat templates use, with the environment transformers'
// apply_chat_template renders them in (a jinja2 ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and
// loop controls; its tojson, raise_exception, strftime_now, dict and namespace). What it implements and what it
// refuses: docs/chat.md. Anything else is refused when the template is parsed (or, for a method of a value, when it
// is called) with a TemplateError naming the construct and the template line.
#pragma once
#include <memory>
#include <stdexcept>
#include <string>

#include "chat/value.h"

namespace hs::chat {

class TemplateError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Program;  // a parsed template

// Throws TemplateError for a syntax error or a construct this interpreter does not implement.
std::shared_ptr<const Program> parse_template(const std::string& source, const std::string& origin);

// Renders with `variables` as the template's context (and the environment's globals beneath them). Throws
// TemplateError for what jinja2 raises at render time (an undefined value used, a type error, raise_exception),
// naming the line.
std::string render_template(const Program& program, const Dict& variables);

}  // namespace hs::chat
