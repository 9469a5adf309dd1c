// The chat page served at / (chat_page.cpp).
#pragma once

namespace hs::serve {
extern const char* const kChatPage;
}  // namespace hs::serve
