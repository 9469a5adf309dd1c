#include "serve/server.h"

#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>

#include "checkpoint/convert.h"
#include "gguf/import.h"
#include "infer/policy.h"
#include "infer/weights.h"
#include "planner/plan.h"
#include "serve/chat.h"
#include "serve/chat_page.h"
#include "serve/connection_deadlines.h"
#include "serve/request.h"
#include "tokenizer/tokenizer.h"

namespace hs::serve {

namespace {

using nlohmann::json;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }
// A server-sent event carrying `j`.
std::string event(const json& j) { return "data: " + dump(j) + "\n\n"; }

// The model as the HTTP side sees it: its name, how text becomes ids and back, what ends an answer.
struct Model {
  std::string name;  // the model id of the API
  std::optional<tokenizer::Tokenizer> tok;
  bool bytes_vocab = false;
  int64_t vocab = 0, context = 0;
  std::vector<int32_t> end_ids;

  std::vector<int32_t> encode(const std::string& text) const {
    std::vector<int32_t> ids;
    if (tok) {
      for (tokenizer::TokenId t : tok->encode(text)) ids.push_back(static_cast<int32_t>(t));
    } else if (bytes_vocab) {
      ids.assign(reinterpret_cast<const unsigned char*>(text.data()),
                 reinterpret_cast<const unsigned char*>(text.data()) + text.size());
    } else {
      throw ApiError(400, "this checkpoint has no tokenizer.json: send the prompt as token ids", "prompt");
    }
    check(ids, "prompt");
    return ids;
  }
  void check(const std::vector<int32_t>& ids, const char* param) const {
    for (int32_t id : ids)
      if (id < 0 || id >= vocab)
        throw ApiError(400, "token " + std::to_string(id) + " is outside the model's vocabulary of " +
                                std::to_string(vocab),
                       param);
  }
  // The bytes of a token; an id of the model's vocabulary that the tokenizer lacks (the embedding is padded past the
  // tokenizer's size, e.g. 248320 rows for Qwen3.5's ~248k tokens) reads as "<id>", as without a tokenizer.
  std::string token_bytes(int32_t id) const {
    if (tok && id >= 0 && static_cast<uint64_t>(id) < static_cast<uint64_t>(tok->vocab_size()))
      return tok->token_bytes(static_cast<tokenizer::TokenId>(id));
    if (bytes_vocab) return std::string(1, static_cast<char>(id));
    std::string s = "<";  // (one append at a time: GCC 12 warns, wrongly, of an overlapping copy in "<" + ... + ">")
    s += std::to_string(id);
    s += '>';
    return s;
  }
  std::string decode(const std::vector<int32_t>& ids) const {
    if (tok) return tok->decode(std::vector<tokenizer::TokenId>(ids.begin(), ids.end()), true);
    std::string s;
    for (int32_t id : ids) s += token_bytes(id);
    return s;
  }
};

// Length of the longest prefix of s that does not end inside a UTF-8 character (bytes that can never be UTF-8 pass).
size_t complete_utf8(const std::string& s) {
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t len = c >= 0xF0 && c < 0xF8 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return len > back ? n - back : n;
  }
  return n;
}

// Ids to text as they come: whole UTF-8 characters only.
class TextStream {
 public:
  explicit TextStream(const Model& m) : m_(m) {
    if (m.tok) dec_.emplace(*m.tok, /*skip_special_tokens=*/true);
  }
  std::string push(int32_t id) {
    if (dec_) return dec_->push(static_cast<tokenizer::TokenId>(id));
    pending_ += m_.token_bytes(id);
    const size_t n = complete_utf8(pending_);
    std::string out = pending_.substr(0, n);
    pending_.erase(0, n);
    return out;
  }
  std::string finish() {
    if (dec_) return dec_->finish();
    return std::exchange(pending_, {});
  }

 private:
  const Model& m_;
  std::optional<tokenizer::StreamDecoder> dec_;
  std::string pending_;
};

struct Counters {
  std::mutex mu;
  std::map<int, int64_t> by_status;
  std::atomic<int64_t> prompt_tokens{0}, completion_tokens{0}, in_flight{0};
};

// One token as the answer reports it.
struct Piece {
  std::string text;  // text that became sendable with this token (may be empty)
  TokenOut token;
};

// A completion request being answered: reads the job's tokens, turns them into text, cuts at stop strings.
struct Session {
  CompletionRequest req;
  std::shared_ptr<Job> job;
  const Model& model;
  TextStream stream;
  std::string response_id, text;
  int64_t created = 0, prompt_tokens = 0, consumed = 0;
  size_t sent = 0;             // text bytes handed out
  std::string finish_reason;   // set once the answer is complete
  std::vector<TokenOut> all;   // every consumed token (logprobs, token ids)
  std::vector<size_t> offsets; // text offset of each consumed token

  Session(CompletionRequest r, std::shared_ptr<Job> j, const Model& m)
      : req(std::move(r)), job(std::move(j)), model(m), stream(m) {}

  // The end of the text that can go out: up to where a stop string could still begin.
  size_t safe_end() const {
    size_t hold = 0;
    for (const std::string& s : req.stop)
      for (size_t k = std::min(s.size() - 1, text.size()); k > hold; --k)
        if (text.compare(text.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    return text.size() - hold;
  }

  // Takes the tokens the engine added since the last call (waiting up to `wait` for one) and returns the pieces they
  // make; finish_reason is set when the answer is over.
  std::vector<Piece> take(std::chrono::milliseconds wait) {
    std::vector<TokenOut> fresh;
    std::string end, error;
    {
      std::unique_lock<std::mutex> lk(job->mu);
      job->cv.wait_for(lk, wait, [&] { return job->finished || static_cast<int64_t>(job->tokens.size()) > consumed; });
      fresh.assign(job->tokens.begin() + consumed, job->tokens.end());
      if (job->finished) {
        end = job->finish_reason;
        error = job->error;
      }
    }
    std::vector<Piece> out;
    for (TokenOut& t : fresh) {
      ++consumed;
      offsets.push_back(text.size());
      all.push_back(t);
      const bool ends =
          !req.ignore_eos && std::find(model.end_ids.begin(), model.end_ids.end(), t.id) != model.end_ids.end();
      const size_t old = text.size();
      // An end id is not part of the text, but bytes of a character it cut short are (as U+FFFD, as decoding says).
      text += ends ? stream.finish() : stream.push(t.id);
      // A stop string ends the answer before it.
      for (const std::string& s : req.stop) {
        const size_t at = text.find(s, old >= s.size() ? old - s.size() + 1 : 0);
        if (at != std::string::npos) {
          text.resize(at);
          finish_reason = "stop";
        }
      }
      const size_t to = finish_reason.empty() ? safe_end() : text.size();
      Piece p;
      p.token = std::move(t);
      if (to > sent) p.text = text.substr(sent, to - sent), sent = to;
      out.push_back(std::move(p));
      if (!finish_reason.empty()) {
        job->cancel = true;  // the scheduler frees the slot at its next pass
        return out;
      }
      if (ends) {
        finish_reason = "stop";
        return out;
      }
    }
    if (!end.empty()) {  // (every token was taken: the scheduler adds none after finishing)
      if (end == "error" || end == "cancelled")
        throw ApiError(500, "generation failed: " + (error.empty() ? end : error), "", "server_error");
      text += stream.finish();
      finish_reason = end;
      if (text.size() > sent) {
        Piece p;
        p.text = text.substr(sent);
        sent = text.size();
        p.token.id = -1;  // text only
        out.push_back(std::move(p));
      }
    }
    return out;
  }

  json usage() const {
    return {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", consumed},
            {"total_tokens", prompt_tokens + consumed},
            {"prompt_tokens_details", {{"cached_tokens", job->cached_tokens}}}};
  }

  json chat_logprob(const TokenOut& t) const {
    auto entry = [&](int32_t id, float lp) {
      const std::string b = model.token_bytes(id);
      return json{{"token", b}, {"logprob", lp}, {"bytes", std::vector<int>(b.begin(), b.end())}};
    };
    json e = entry(t.id, t.logprob);
    e["top_logprobs"] = json::array();
    for (const auto& [id, lp] : t.top) e["top_logprobs"].push_back(entry(id, lp));
    for (auto& x : e["bytes"]) x = x.get<int>() & 0xFF;
    return e;
  }
  json completion_logprobs(size_t from, size_t to) const {
    json l = {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
    for (size_t i = from; i < to; ++i) {
      l["tokens"].push_back(model.token_bytes(all[i].id));
      l["token_logprobs"].push_back(all[i].logprob);
      json top = json::object();
      for (const auto& [id, lp] : all[i].top) top[model.token_bytes(id)] = lp;
      l["top_logprobs"].push_back(top);
      l["text_offset"].push_back(offsets[i]);
    }
    return l;
  }
};

// cpp-httplib (0.11) runs a content provider outside its own try/catch: an exception escaping one would end the
// process. Every provider is wrapped: whatever it throws ends that answer with an error body, the others go on.
template <typename Provider, typename ErrorText>
auto never_throws(Provider provider, ErrorText error_text) {
  return [provider = std::move(provider), error_text](size_t offset, httplib::DataSink& sink) mutable -> bool {
    try {
      return provider(offset, sink);
    } catch (const std::exception& e) {
      const std::string out = error_text(e);
      sink.write(out.data(), out.size());
      sink.done();
      return true;
    }
  };
}

// A request that failed after its answer began: its job is cancelled (the scheduler frees the slot) and the client
// gets a server error saying what failed.
ApiError failure(Session& s, const std::exception& e) {
  s.job->cancel = true;
  s.finish_reason = "error";
  return ApiError(500, std::string("generation failed: ") + e.what(), "", "server_error");
}


class Server {
 public:
  explicit Server(const ServeOptions& opt);
  int run();

 private:
  void error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    res.set_content(dump(e.body()), "application/json");
  }
  void completion(const httplib::Request& req, httplib::Response& res, Endpoint ep);
  void answer(std::shared_ptr<Session> s, httplib::Response& res);
  std::string answer_body(Session& s);
  void stream(std::shared_ptr<Session> s, httplib::Response& res);
  json completion_object(const Session& s, const char* object, json choices) const;
  void send_chunked(std::shared_ptr<Session> s, httplib::Response& res, const char* content_type,
                    httplib::ContentProviderWithoutLength provider);
  std::string metrics_text();
  std::vector<int32_t> prompt_ids(const CompletionRequest& r) const;

  ServeOptions opt_;
  gguf::CheckpointPath source_;  // a .gguf file imported for the run (its config, tokenizer, chat template; its
                                 // tensors only when they are dequantized)
  checkpoint::CheckpointDir dir_;
  ChatFormat chat_;
  MemoryAccountant mem_;
  std::unique_ptr<infer::InferenceWeights> weights_;
  Model model_;
  std::unique_ptr<Engine> engine_;
  planner::ServePlan plan_;
  ConnectionDeadlines deadlines_{std::chrono::seconds(opt_.request_timeout_s)};  // outlives http_'s task queue
  httplib::Server http_;
  Counters counters_;
  std::atomic<int64_t> next_id_{1};
  std::atomic<bool> draining_{false};
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

Server::Server(const ServeOptions& opt)
    : opt_(opt),
      source_(opt.checkpoint.string(), opt.gguf_blocks ? gguf::CheckpointPath::Weights::FromBlocks
                                                       : gguf::CheckpointPath::Weights::Dequantized),
      dir_(checkpoint::open_checkpoint_dir(source_.path())),
      chat_(dir_.path, opt.chat_template) {
  const model::ModelConfig& cfg = dir_.config;
  model_.name = std::filesystem::weakly_canonical(opt.checkpoint).filename().string();
  if (model_.name.empty()) model_.name = "hybridscan";
  if (std::filesystem::exists(dir_.path / "tokenizer.json"))
    model_.tok = tokenizer::Tokenizer::load((dir_.path / "tokenizer.json").string());
  model_.bytes_vocab = !model_.tok && cfg.vocab == 256;
  model_.vocab = cfg.vocab;
  model_.end_ids = infer::end_ids(dir_.config_json, model_.tok ? &*model_.tok : nullptr);
  EngineOptions eo = opt.engine;
  const int64_t model_ctx = infer::model_context(dir_.config_json);
  if (eo.context <= 0) eo.context = model_ctx > 0 ? std::min<int64_t>(model_ctx, 4096) : 4096;
  if (model_ctx > 0 && eo.context > model_ctx)
    throw std::invalid_argument("a context of " + std::to_string(eo.context) + " positions is past the model's " +
                                std::to_string(model_ctx) + " (max_position_embeddings)");
  model_.context = eo.context;
  // (Checked before the weights load: the engine checks the same, later.)
  if (eo.draft > 0 && cfg.mtp_layers < 1)
    throw std::invalid_argument("--speculative mtp: checkpoint " + opt.checkpoint.string() + " has no "
                                "multi-token-prediction layer (mtp.*) to draft with (a model trained from a '+mtp' "
                                "preset, or a released Qwen3-Next / Qwen3.5 checkpoint with its mtp.* tensors); serve "
                                "it without --speculative");
  if (eo.draft > 0 && opt.gguf_blocks)
    throw std::invalid_argument("--speculative mtp does not run with --gguf-blocks (the MTP layer and the verification "
                                "need weights in the compute dtype)");
  if (opt.gguf_blocks && !gguf::is_gguf_path(opt.checkpoint.string()))
    throw std::invalid_argument("--gguf-blocks serves a .gguf file from its quantized blocks; " +
                                opt.checkpoint.string() + " is not one");
  if (opt.gguf_blocks && !opt.weight_dtype.empty())
    throw std::invalid_argument("--gguf-blocks keeps the file's own types: leave --weight-dtype unset");
  weights_ = opt.gguf_blocks
                 ? infer::load_gguf_weights(opt.checkpoint.string(), mem_)
                 : infer::load_weights(dir_, opt.weight_dtype.empty() ? std::nullopt
                                                                      : std::optional<DType>(parse_dtype(opt.weight_dtype)),
                                       mem_, infer::parse_weights_memory(opt.weights_memory));
  const model::ParamSet& params = *weights_->params;
  const infer::QuantWeights* quant = weights_->quant.get();
  const DType compute = quant ? DType::F32 : params.global(model::g::kLmHead).dtype;  // quantized: fp32 compute
  planner::ServePlanRequest pr;
  pr.model = cfg;
  pr.context = eo.context;
  pr.parallel = eo.parallel;
  pr.cache_bytes = eo.cache_bytes;
  pr.weight_dtype = compute;
  pr.draft = eo.draft;
  if (quant) pr.gguf_path = opt.checkpoint.string();  // planned from its quantized blocks, as it runs
  plan_ = planner::plan_serve(pr);
  engine_ = std::make_unique<Engine>(params, compute, eo, mem_, quant);
}

std::vector<int32_t> Server::prompt_ids(const CompletionRequest& r) const {
  if (r.endpoint == Endpoint::Chat) return model_.encode(chat_.render(r.messages, true));
  if (r.prompt_is_ids) {
    model_.check(r.prompt_ids, "prompt");
    return r.prompt_ids;
  }
  return model_.encode(r.prompt);
}

void Server::completion(const httplib::Request& hreq, httplib::Response& res, Endpoint ep) {
  CompletionRequest r = parse_completion(hreq.body, ep);
  if (!r.model.empty() && r.model != model_.name)
    throw ApiError(400, "the model '" + r.model + "' is not served here: this server serves '" + model_.name +
                            "' (GET /v1/models)",
                   "model", "invalid_request_error", "model_not_found");
  const std::vector<int32_t> prompt = prompt_ids(r);
  const int64_t n = static_cast<int64_t>(prompt.size()), ctx = model_.context;
  if (n == 0)
    throw ApiError(400, ep == Endpoint::Chat ? "the chat template rendered these messages to no tokens"
                                             : "the prompt encodes to no tokens: give at least one",
                   ep == Endpoint::Chat ? "messages" : "prompt");
  if (n >= ctx)
    throw ApiError(400, "the prompt's " + std::to_string(n) + " tokens leave no room in the context of " +
                            std::to_string(ctx) + " positions (shorten the prompt, or start the server with a larger "
                            "--ctx)",
                   ep == Endpoint::Chat ? "messages" : "prompt", "invalid_request_error", "context_length_exceeded");
  if (r.max_tokens && *r.max_tokens > ctx - n)  // (not n + max_tokens: a max_tokens near INT64_MAX would wrap)
    throw ApiError(400, "max_tokens " + std::to_string(*r.max_tokens) + " plus the prompt's " + std::to_string(n) +
                            " tokens pass the context of " + std::to_string(ctx) + " positions (at most " +
                            std::to_string(ctx - n) + " here)",
                   "max_tokens", "invalid_request_error", "context_length_exceeded");
  auto job = std::make_shared<Job>();
  job->prompt = prompt;
  job->max_tokens = r.max_tokens ? *r.max_tokens : ctx - n;
  job->sampling = {r.temperature, r.top_k, r.top_p, r.seed ? *r.seed : std::random_device{}()};
  job->top_logprobs = r.logprobs ? r.top_logprobs : -1;
  if (!r.ignore_eos) job->stop_ids = model_.end_ids;
  switch (engine_->submit(job)) {
    case Engine::Admit::Full:
      res.set_header("Retry-After", "1");
      throw ApiError(429, "every slot and the queue are busy: retry shortly", "", "rate_limit_exceeded");
    case Engine::Admit::Draining:
      res.set_header("Retry-After", "5");
      throw ApiError(503, "the server is shutting down", "", "server_error");
    case Engine::Admit::Ok: break;
  }
  auto s = std::make_shared<Session>(std::move(r), job, model_);
  s->response_id = (ep == Endpoint::Chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id_++);
  s->created = static_cast<int64_t>(std::time(nullptr));
  s->prompt_tokens = n;
  counters_.prompt_tokens += n;
  if (s->req.stream) stream(s, res);
  else answer(s, res);
}

// What every answer and chunk of `s` carries around its choices; `object` is the API's name for what it is.
json Server::completion_object(const Session& s, const char* object, json choices) const {
  return {{"id", s.response_id},
          {"object", object},
          {"created", s.created},
          {"model", model_.name},
          {"choices", std::move(choices)}};
}

// Writes a chunk of `s`'s chunked response (nothing when `out` is empty) and ends the response once `s` is finished;
// a client gone (the write fails) cancels the request.
bool write_chunk(Session& s, httplib::DataSink& sink, const std::string& out) {
  if (!out.empty() && !sink.write(out.data(), out.size())) {
    s.job->cancel = true;
    return false;
  }
  if (!s.finish_reason.empty()) sink.done();
  return true;
}

// Sends `s` as a chunked response whose chunks `provider` writes. It counts as in flight until the response ends,
// and however it ends (finished, failed, client gone) the generation stops and its tokens are counted.
void Server::send_chunked(std::shared_ptr<Session> s, httplib::Response& res, const char* content_type,
                          httplib::ContentProviderWithoutLength provider) {
  ++counters_.in_flight;
  const bool sse = std::string_view(content_type) == "text/event-stream";
  auto error_text = [s, sse](const std::exception& e) {
    const json body = failure(*s, e).body();
    return sse ? event(body) : dump(body);
  };
  res.set_chunked_content_provider(content_type, never_throws(std::move(provider), error_text), [s, this](bool) {
    s->job->cancel = true;
    counters_.completion_tokens += s->consumed;
    --counters_.in_flight;
  });
}

// The JSON answer of a request that is not streamed.
std::string Server::answer_body(Session& s) {
  json choice = {{"index", 0}, {"finish_reason", s.finish_reason}, {"logprobs", nullptr}};
  if (s.req.endpoint == Endpoint::Chat) {
    choice["message"] = {{"role", "assistant"}, {"content", s.text}};
    if (s.req.logprobs) {
      json c = json::array();
      for (const TokenOut& t : s.all) c.push_back(s.chat_logprob(t));
      choice["logprobs"] = {{"content", c}};
    }
  } else {
    choice["text"] = s.text;
    if (s.req.logprobs) choice["logprobs"] = s.completion_logprobs(0, s.all.size());
  }
  if (s.req.return_tokens) {
    std::vector<int32_t> ids;
    for (const TokenOut& t : s.all) ids.push_back(t.id);
    choice["token_ids"] = ids;
  }
  json out = completion_object(s, s.req.endpoint == Endpoint::Chat ? "chat.completion" : "text_completion",
                               json::array({choice}));
  out["usage"] = s.usage();
  return dump(out);
}

// An answer ready within a second goes out as a plain response. A longer one is sent chunked, led by a space each
// second while it is being generated (JSON allows whitespace before the value): a client that has gone makes such a
// write fail, which cancels the request, so its slot is freed as a streaming client's is. (The status is 200 by then:
// a generation that fails later sends the error body with it.)
void Server::answer(std::shared_ptr<Session> s, httplib::Response& res) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  try {
    while (s->finish_reason.empty() && std::chrono::steady_clock::now() < until) s->take(std::chrono::milliseconds(100));
  } catch (...) {
    s->job->cancel = true;
    throw;
  }
  if (!s->finish_reason.empty()) {
    s->job->cancel = true;
    counters_.completion_tokens += s->consumed;
    res.set_content(answer_body(*s), "application/json");
    return;
  }
  send_chunked(s, res, "application/json", [s, this](size_t, httplib::DataSink& sink) {
    std::string out;
    try {
      const auto beat = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      while (s->finish_reason.empty() && std::chrono::steady_clock::now() < beat)
        s->take(std::chrono::milliseconds(100));
      out = s->finish_reason.empty() ? " " : answer_body(*s);
    } catch (const ApiError& e) {
      out = dump(e.body());
      s->finish_reason = "error";
    }
    return write_chunk(*s, sink, out);
  });
}

// Server-sent events: a chunk per token (its text, and its logprobs / id when asked), a last chunk with the finish
// reason, a chunk with the usage, then "data: [DONE]". A client gone (a write fails) cancels the request.
void Server::stream(std::shared_ptr<Session> s, httplib::Response& res) {
  const bool chat = s->req.endpoint == Endpoint::Chat;
  const char* object = chat ? "chat.completion.chunk" : "text_completion";
  auto chunk = [s, object, this](json choice) {
    choice["index"] = 0;
    if (!choice.contains("finish_reason")) choice["finish_reason"] = nullptr;
    if (!choice.contains("logprobs")) choice["logprobs"] = nullptr;
    return event(completion_object(*s, object, json::array({choice})));
  };
  auto started = std::make_shared<bool>(false);
  res.set_header("Cache-Control", "no-cache");
  send_chunked(s, res, "text/event-stream", [s, chat, object, chunk, started, this](size_t, httplib::DataSink& sink) {
    std::string out;
    if (!*started) {
      *started = true;
      if (chat) out += chunk({{"delta", {{"role", "assistant"}, {"content", ""}}}});
    }
    std::vector<Piece> pieces;
    try {
      pieces = s->take(std::chrono::milliseconds(200));
    } catch (const ApiError& e) {
      out += event(e.body());
      sink.write(out.data(), out.size());
      sink.done();
      return true;
    }
    // Pieces are tokens but for a last text-only one (id -1: text held back until the end); s->all holds tokens.
    size_t token_pieces = 0;
    for (const Piece& p : pieces) token_pieces += p.token.id >= 0;
    size_t k = s->all.size() - token_pieces;  // the index in s->all of the next token piece
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& p = pieces[i];
      const size_t index = p.token.id >= 0 ? k++ : 0;  // this token's place in s->all
      if (p.text.empty() && !s->req.return_tokens && !s->req.logprobs) continue;
      json choice;
      if (chat) choice["delta"] = {{"content", p.text}};
      else choice["text"] = p.text;
      if (p.token.id >= 0) {
        if (s->req.logprobs)
          choice["logprobs"] = chat ? json{{"content", json::array({s->chat_logprob(p.token)})}}
                                    : s->completion_logprobs(index, index + 1);
        if (s->req.return_tokens) choice["token_ids"] = json::array({p.token.id});
      }
      out += chunk(choice);
    }
    if (!s->finish_reason.empty()) {
      json choice = {{"finish_reason", s->finish_reason}};
      if (chat) choice["delta"] = json::object();
      else choice["text"] = "";
      out += chunk(choice);
      if (s->req.include_usage) {
        json usage = completion_object(*s, object, json::array());
        usage["usage"] = s->usage();
        out += event(usage);
      }
      out += "data: [DONE]\n\n";
    }
    return write_chunk(*s, sink, out);
  });
}

size_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

std::string Server::metrics_text() {
  std::ostringstream o;
  auto metric = [&o](const char* name, const char* type, const char* help, auto value) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n' << name << ' ' << value << '\n';
  };
  {
    std::lock_guard<std::mutex> lk(counters_.mu);
    o << "# HELP hybridscan_requests_total HTTP requests answered, by status\n"
         "# TYPE hybridscan_requests_total counter\n";
    for (const auto& [status, n] : counters_.by_status)
      o << "hybridscan_requests_total{status=\"" << status << "\"} " << n << '\n';
  }
  const EngineMetrics& m = engine_->metrics();
  const double pre_s = double(m.prefill_ns.load()) * 1e-9, dec_s = double(m.decode_ns.load()) * 1e-9;
  metric("hybridscan_prompt_tokens_total", "counter", "Prompt tokens of accepted requests",
         counters_.prompt_tokens.load());
  metric("hybridscan_generated_tokens_total", "counter", "Tokens generated and delivered",
         counters_.completion_tokens.load());
  metric("hybridscan_prefill_tokens_total", "counter", "Prompt tokens prefilled (not served from the prefix cache)",
         m.prefill_tokens.load());
  metric("hybridscan_decode_tokens_total", "counter", "Tokens decoded by decode steps", m.decode_tokens.load());
  metric("hybridscan_decode_steps_total", "counter", "Decode steps run", m.steps.load());
  if (const int64_t draft = engine_->options().draft; draft > 0) {
    // Speculative decoding: accepted{position=k} / verifications is the share of steps that kept drafts 1..k, and
    // decode tokens / verifications the tokens a request gains per step.
    metric("hybridscan_spec_draft", "gauge", "Tokens drafted per request and step (--draft)", draft);
    metric("hybridscan_spec_verifications_total", "counter", "Verifications (one per request and decode step)",
           m.spec_verifications.load());
    metric("hybridscan_spec_drafted_total", "counter", "Draft tokens proposed by the MTP layer", m.spec_drafted.load());
    o << "# HELP hybridscan_spec_accepted_total Verifications whose drafts 1..position were all kept\n"
         "# TYPE hybridscan_spec_accepted_total counter\n";
    for (int64_t k = 0; k < draft; ++k)
      o << "hybridscan_spec_accepted_total{position=\"" << k + 1 << "\"} "
        << m.spec_accepted[static_cast<size_t>(k)].load() << '\n';
  }
  metric("hybridscan_prefill_tokens_per_second", "gauge", "Prefill throughput while prefilling",
         pre_s > 0 ? double(m.prefill_tokens.load()) / pre_s : 0.0);
  metric("hybridscan_decode_tokens_per_second", "gauge", "Decode throughput while decoding (all slots)",
         dec_s > 0 ? double(m.decode_tokens.load()) / dec_s : 0.0);
  metric("hybridscan_decode_gap_max_seconds", "gauge",
         "The longest wait between two decode steps while requests were decoding (prefill chunks run between them)",
         double(m.decode_gap_max_ns.load()) * 1e-9);
  metric("hybridscan_prefill_seconds_total", "counter", "Time spent prefilling", pre_s);
  metric("hybridscan_queue_length", "gauge", "Requests waiting for a slot", m.queued.load());
  metric("hybridscan_busy_slots", "gauge", "Slots holding a request", m.busy_slots.load());
  metric("hybridscan_slots", "gauge", "Slots (--parallel)", engine_->options().parallel);
  metric("hybridscan_cache_hits_total", "counter", "Requests that restored a cached prefix", m.cache_hits.load());
  metric("hybridscan_cache_misses_total", "counter", "Requests that found no cached prefix", m.cache_misses.load());
  metric("hybridscan_cached_tokens_total", "counter", "Prompt tokens served from the prefix cache", m.cached_tokens.load());
  const PrefixCache* c = engine_->cache();
  metric("hybridscan_cache_bytes", "gauge", "Bytes held by the prefix cache", c ? c->bytes() : 0);
  metric("hybridscan_cache_budget_bytes", "gauge", "The prefix cache's budget (--cache-bytes)", c ? c->budget() : 0);
  metric("hybridscan_cache_nodes", "gauge", "64-token chunks held by the prefix cache", c ? c->nodes() : 0);
  metric("hybridscan_cache_evictions_total", "counter", "Chunks evicted from the prefix cache", c ? c->evictions() : 0);
  metric("hybridscan_memory_accounted_bytes", "gauge", "Bytes live in the memory accountant", mem_.live_total());
  metric("hybridscan_memory_accounted_peak_bytes", "gauge", "The memory accountant's peak", mem_.peak_total());
  metric("hybridscan_memory_planned_peak_bytes", "gauge",
         "The peak plan --serve gives for these options (weights counted whole; a .gguf's quantized blocks included)",
         plan_.total);
  metric("hybridscan_weights_mapped_bytes", "gauge", "Weight bytes used in place from the checkpoint's files (outside "
         "the accountant)", weights_->mapped_bytes);
  metric("hybridscan_resident_bytes", "gauge", "The process's resident set now", resident_bytes());
  metric("hybridscan_resident_peak_bytes", "gauge", "The process's peak resident set", peak_resident_bytes());
  metric("hybridscan_connections_timed_out_total", "counter",
         "Connections dropped because a request did not arrive whole within --request-timeout", deadlines_.dropped());
  metric("hybridscan_uptime_seconds", "gauge", "Seconds since the server started",
         std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  return o.str();
}

int Server::run() {
  const EngineOptions& eo = engine_->options();
  // The connection pool, each connection's requests under --request-timeout (serve/connection_deadlines.h).
  http_.new_task_queue = [this, n = static_cast<size_t>(eo.parallel + eo.queue + 16)] {
    return deadlines_.queue(new httplib::ThreadPool(n));
  };
  http_.set_payload_max_length(opt_.max_body);
  http_.set_read_timeout(opt_.read_timeout_s, 0);
  http_.set_write_timeout(opt_.write_timeout_s, 0);
  // Keep-alive: longer than clients keep idle connections (httpx, under the openai client: 5 s), so a client never
  // reuses a connection the server is closing at that moment (a connection error to it); many requests a connection,
  // so bursts of clients do not reconnect every few requests (cpp-httplib's listen backlog is 5).
  http_.set_keep_alive_timeout(15);
  http_.set_keep_alive_max_count(10000);
  // Errors httplib answers itself (413, 404, 400 for a broken request line) get an OpenAI-style body too.
  http_.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string msg = res.status == 413   ? "the request body is larger than --max-body (" + std::to_string(opt_.max_body) +
                                                " bytes)"
                      : res.status == 404 ? "no such endpoint: " + req.method + " " + req.path
                                          : "the request could not be read";
    res.set_content(dump(ApiError(res.status, msg).body()), "application/json");
  });
  http_.set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    try {
      std::rethrow_exception(ep);
    } catch (const ApiError& e) {
      error(res, e);
    } catch (const std::exception& e) {
      error(res, ApiError(500, std::string("internal error: ") + e.what(), "", "server_error"));
    }
  });
  http_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (opt_.api_key.empty() || req.path == "/" || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    if (auth != "Bearer " + opt_.api_key) {
      error(res, ApiError(401, auth.empty() ? "no API key: send the header 'Authorization: Bearer KEY'"
                                            : "the API key is not valid",
                          "", "invalid_request_error", "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Called once an answer is written: the connection's next request is due within --request-timeout.
  http_.set_logger([this](const httplib::Request&, const httplib::Response& res) {
    ConnectionDeadlines::request_read();  // (an answer httplib wrote itself, e.g. 413: its request is done too)
    ConnectionDeadlines::response_written();
    std::lock_guard<std::mutex> lk(counters_.mu);
    ++counters_.by_status[res.status];
  });
  // Every handler: the request has been read whole (line, headers, body), so its deadline stops; API errors
  // become OpenAI-style bodies.
  auto guard = [this](auto fn) {
    return [this, fn](const httplib::Request& req, httplib::Response& res) {
      ConnectionDeadlines::request_read();
      try {
        fn(req, res);
      } catch (const ApiError& e) {
        error(res, e);
      }
    };
  };
  http_.Post("/v1/chat/completions", guard([this](const httplib::Request& q, httplib::Response& r) {
               completion(q, r, Endpoint::Chat);
             }));
  http_.Post("/v1/completions", guard([this](const httplib::Request& q, httplib::Response& r) {
               completion(q, r, Endpoint::Completion);
             }));
  http_.Get("/v1/models", guard([this](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", model_.name}, {"object", "model"}, {"created", 0}, {"owned_by", "hybridscan"},
              {"context_length", model_.context}};
    res.set_content(dump({{"object", "list"}, {"data", json::array({m})}}), "application/json");
  }));
  http_.Get("/health", guard([this](const httplib::Request&, httplib::Response& res) {
    if (draining_) {
      res.status = 503;
      res.set_content(R"({"status":"draining"})", "application/json");
    } else {
      res.set_content(R"({"status":"ok"})", "application/json");
    }
  }));
  http_.Get("/metrics", guard([this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4");
  }));
  http_.Post("/tokenize", guard([this](const httplib::Request& q, httplib::Response& res) {
               const TokenizeRequest t = parse_tokenize(q.body);
               const std::string text = t.messages.is_null() ? t.content : chat_.render(t.messages, t.add_generation_prompt);
               res.set_content(dump({{"tokens", model_.encode(text)}}), "application/json");
             }));
  http_.Post("/detokenize", guard([this](const httplib::Request& q, httplib::Response& res) {
               const std::vector<int32_t> ids = parse_detokenize(q.body);
               model_.check(ids, "tokens");
               res.set_content(dump({{"content", model_.decode(ids)}}), "application/json");
             }));
  http_.Get("/", guard([](const httplib::Request&, httplib::Response& res) {
    res.set_content(kChatPage, "text/html; charset=utf-8");
  }));

  // SIGTERM / SIGINT (blocked in every thread by run_server): a thread of its own waits for them, stops admitting,
  // lets the running requests finish, then stops the listener.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int port = opt_.port;
  if (port == 0) port = http_.bind_to_any_port(opt_.host);
  else if (!http_.bind_to_port(opt_.host, port)) port = -1;
  if (port < 0)
    throw std::runtime_error("cannot listen on " + opt_.host + ":" + std::to_string(opt_.port) +
                             " (in use? choose another --port)");
  std::thread signals([this, set] {
    int sig = 0;
    sigwait(&set, &sig);
    draining_ = true;
    std::fprintf(stderr, "serve: signal %d: finishing the running requests\n", sig);
    engine_->drain();
    // The streams' last bytes: each handler leaves once its answer is written.
    for (int i = 0; i < 300 && counters_.in_flight.load() > 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    http_.stop();
  });
  const std::string spec = eo.draft > 0 ? ", speculative mtp, draft " + std::to_string(eo.draft) : "";
  std::fprintf(stderr, "serve: %s on http://%s:%d (%lld slots of %lld positions%s, prefix cache %s; planned peak %s)\n",
               model_.name.c_str(), opt_.host.c_str(), port, (long long)eo.parallel, (long long)eo.context,
               spec.c_str(), format_bytes(double(eo.cache_bytes)).c_str(),
               format_bytes(double(plan_.total)).c_str());
  if (opt_.on_listening) opt_.on_listening(port);
  const bool ok = http_.listen_after_bind();
  if (!draining_) kill(getpid(), SIGTERM);  // the listener ended on its own: let the signal thread finish
  signals.join();
  std::fprintf(stderr, "serve: stopped\n");
  return ok ? 0 : 1;
}

}  // namespace

int run_server(const ServeOptions& opt) {
  // Before any thread starts (the scheduler, OpenMP's, the HTTP pool): they inherit the mask, so only the server's
  // signal thread ever takes SIGTERM / SIGINT.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  Server s(opt);
  return s.run();
}

}  // namespace hs::serve
