#include "serve/chat_page.h"

namespace hs::serve {
const char* const kChatPage = R"HTML(<!doctype html><title>hybridscan</title><p>hybridscan serve)HTML";
}  // namespace hs::serve
