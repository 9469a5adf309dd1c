// The OpenAI-style request bodies the server takes (POST /v1/chat/completions, /v1/completions, /tokenize,
// /detokenize), parsed and checked before anything is tokenized: every way a body can be wrong is an ApiError with
// the HTTP status and the OpenAI error body's fields, never a crash (fuzz/serve_request_fuzzer.cpp).
#pragma once
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace hs::serve {

// An answer other than 200: status, and the body {"error": {"message", "type", "param", "code"}}.
struct ApiError : std::runtime_error {
  int status;
  std::string type, param, code;
  ApiError(int status_, std::string message, std::string param_ = "", std::string type_ = "invalid_request_error",
           std::string code_ = "")
      : std::runtime_error(std::move(message)), status(status_), type(std::move(type_)), param(std::move(param_)),
        code(std::move(code_)) {}
  nlohmann::json body() const;
};

enum class Endpoint { Chat, Completion };

struct CompletionRequest {
  Endpoint endpoint = Endpoint::Completion;
  std::string model;                    // as asked ("" when absent)
  nlohmann::json messages;              // chat: [{role, content}] with content made plain text
  std::string prompt;                   // completion: text ...
  std::vector<int32_t> prompt_ids;      // ... or token ids (one of the two)
  bool prompt_is_ids = false;
  std::optional<int64_t> max_tokens;    // absent: up to the context
  double temperature = 1, top_p = 1;
  int64_t top_k = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool stream = false, include_usage = true;
  bool logprobs = false;
  int64_t top_logprobs = 0;
  bool return_tokens = false;           // extension: the token ids of the answer ("token_ids")
  bool ignore_eos = false;              // extension (llama-server's): the end ids do not end the answer
};

// Throws ApiError (400) for malformed JSON, a field of the wrong type or out of range, a missing prompt/messages.
CompletionRequest parse_completion(std::string_view body, Endpoint endpoint);

// /tokenize: {"content": text} or {"messages": [...]} (chat-rendered); /detokenize: {"tokens": [ids]}.
struct TokenizeRequest {
  std::string content;
  nlohmann::json messages;  // null when content is given
  bool add_generation_prompt = true;
};
TokenizeRequest parse_tokenize(std::string_view body);
std::vector<int32_t> parse_detokenize(std::string_view body);

}  // namespace hs::serve
