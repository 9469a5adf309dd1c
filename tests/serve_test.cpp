// The server's pieces in process: the decoder's snapshots and the prefix cache (a restored prefix continues to the
// same bits as a cold prefill in the same 64-token pieces; eviction keeps the budget), and the request parser
// (every malformed body an ApiError, never another exception; a fixed-seed random fuzz beside fuzz/'s libFuzzer one).
// The HTTP server end to end, with the openai client: tests/serve_test.py.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include <nlohmann/json.hpp>

#include "checkpoint/hf_io.h"
#include "infer/decoder.h"
#include "serve/prefix_cache.h"
#include "serve/request.h"
#include "test_util.h"

namespace hs::serve {
namespace {

const std::string kCase = test::source_dir() + "/tests/fixtures/parity/qwen3_next_L5";

struct Model {
  MemoryAccountant mem;
  std::unique_ptr<model::ParamSet> params;
  explicit Model(DType dt) {
    params = std::make_unique<model::ParamSet>(model::load_config(kCase), dt, mem, MemCategory::Parameters, false);
    checkpoint::load_hf_params(checkpoint::CheckpointReader(kCase + "/model.safetensors"), *params);
  }
};

std::vector<int32_t> tokens(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(g() % 256);
  return t;
}

// Prefills ids[from, end) in the engine's pieces (up to each 64-token edge); the logits of the last token.
std::vector<float> prefill_from(infer::Decoder& d, int64_t slot, const std::vector<int32_t>& ids, int64_t from) {
  std::vector<float> logits(static_cast<size_t>(d.config().vocab));
  const int64_t n = static_cast<int64_t>(ids.size());
  for (int64_t p = from; p < n;) {
    const int64_t m = std::min(64 - p % 64, n - p);
    d.prefill(slot, std::span<const int32_t>(ids).subspan(static_cast<size_t>(p), static_cast<size_t>(m)),
              p + m == n ? logits.data() : nullptr);
    p += m;
  }
  return logits;
}

// A prefix restored from the cache (into another slot) continues to the bits of a cold prefill, then decodes alike.
// It fails if a snapshot misses a part of the state (a layer's conv window, a head's keys) or lands at the wrong
// positions: the bf16 test of Decode.* shows a lost state moves the logits by ~1.
void expect_restore_is_exact(DType dt) {
  Model m(dt);
  infer::Decoder d(*m.params, dt, 3, 512, m.mem, PrefixCache::kChunk);
  PrefixCache cache(64 << 20, m.mem);
  const std::vector<int32_t> a = tokens(300, 1);
  d.reset(0);
  const std::vector<float> cold = prefill_from(d, 0, a, 0);
  // The cache's snapshots, from a third slot prefilled edge by edge.
  d.reset(2);
  for (int64_t e = 64; e <= 256; e += 64) {
    prefill_from(d, 2, std::vector<int32_t>(a.begin(), a.begin() + e), e - 64);
    cache.insert(d, 2, std::span<const int32_t>(a).first(static_cast<size_t>(e)));
  }
  EXPECT_EQ(cache.nodes(), 4);
  d.reset(1);
  const int64_t got = cache.restore(d, 1, a, 299);
  ASSERT_EQ(got, 256);
  const std::vector<float> warm = prefill_from(d, 1, a, got);
  EXPECT_EQ(std::memcmp(cold.data(), warm.data(), cold.size() * sizeof(float)), 0) << dtype_name(dt);
  // Then a few decode steps of both slots together: row by row the same bits.
  std::vector<int32_t> slots{0, 1}, ids{7, 7};
  std::vector<float> l(2 * cold.size());
  for (int s = 0; s < 4; ++s) {
    d.step(slots, ids, l.data());
    EXPECT_EQ(std::memcmp(l.data(), l.data() + cold.size(), cold.size() * sizeof(float)), 0) << "step " << s;
    ids = {static_cast<int32_t>(s * 31 % 256), static_cast<int32_t>(s * 31 % 256)};
  }
  // A prompt that diverges inside the third chunk restores the first two.
  std::vector<int32_t> b = a;
  b[150] ^= 1;
  d.reset(1);
  EXPECT_EQ(cache.restore(d, 1, b, 299), 128);
  // The limit: a 256-token prompt may restore at most 192 (one token must stay to prefill).
  d.reset(1);
  EXPECT_EQ(cache.restore(d, 1, std::span<const int32_t>(a).first(256), 255), 192);
}

TEST(ServeCache, RestoredPrefixContinuesToTheSameBitsFp32) { expect_restore_is_exact(DType::F32); }
TEST(ServeCache, RestoredPrefixContinuesToTheSameBitsBf16) { expect_restore_is_exact(DType::BF16); }

// A budget of three nodes: a fourth chunk evicts the least recently used leaf, never the path being extended, and
// the bytes stay within the budget.
TEST(ServeCache, EvictsLeastRecentlyUsedLeavesWithinTheBudget) {
  Model m(DType::F32);
  infer::Decoder d(*m.params, DType::F32, 1, 512, m.mem, PrefixCache::kChunk);
  const size_t node = PrefixCache::node_bytes(d);
  PrefixCache cache(3 * node, m.mem);
  auto fill = [&](const std::vector<int32_t>& ids) {
    d.reset(0);
    for (int64_t e = 64; e <= static_cast<int64_t>(ids.size()); e += 64) {
      prefill_from(d, 0, std::vector<int32_t>(ids.begin(), ids.begin() + e), e - 64);
      cache.insert(d, 0, std::span<const int32_t>(ids).first(static_cast<size_t>(e)));
    }
  };
  const std::vector<int32_t> a = tokens(128, 1), b = tokens(64, 2), c = tokens(128, 3);
  fill(a);  // a0 a1
  fill(b);  // b0
  EXPECT_EQ(cache.nodes(), 3);
  EXPECT_EQ(cache.bytes(), 3 * node);
  d.reset(0);
  EXPECT_EQ(cache.restore(d, 0, a, 128), 128);  // a is now the most recent
  fill(c);  // c0 evicts b0 (the oldest leaf); c1 evicts a1, then a0 is a leaf
  EXPECT_LE(cache.bytes(), 3 * node);
  EXPECT_EQ(cache.evictions(), 2);
  d.reset(0);
  EXPECT_EQ(cache.restore(d, 0, b, 64), 0);
  d.reset(0);
  EXPECT_EQ(cache.restore(d, 0, c, 128), 128);
  d.reset(0);
  EXPECT_EQ(cache.restore(d, 0, a, 128), 64);
  EXPECT_EQ(m.mem.live(MemCategory::Activations) - d.kv_cache_bytes() - d.recurrent_state_bytes(), cache.bytes());
}

TEST(ServeRequest, ParsesTheOpenAiFields) {
  const CompletionRequest r = parse_completion(
      R"({"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
          "max_tokens":5,"temperature":0.5,"top_p":0.9,"top_k":3,"seed":7,"stop":["x","y"],"stream":true,
          "logprobs":true,"top_logprobs":2})",
      Endpoint::Chat);
  EXPECT_EQ(r.messages[1]["content"], "ab");
  EXPECT_EQ(*r.max_tokens, 5);
  EXPECT_EQ(r.temperature, 0.5);
  EXPECT_EQ(r.top_k, 3);
  EXPECT_EQ(*r.seed, 7u);
  EXPECT_EQ(r.stop.size(), 2u);
  EXPECT_TRUE(r.stream && r.logprobs);
  EXPECT_EQ(r.top_logprobs, 2);
  const CompletionRequest c = parse_completion(R"({"prompt":[1,2,3],"logprobs":2,"stop":"z"})", Endpoint::Completion);
  EXPECT_TRUE(c.prompt_is_ids);
  EXPECT_EQ(c.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(c.top_logprobs, 2);
  EXPECT_FALSE(c.max_tokens.has_value());
}

TEST(ServeRequest, BadBodiesAre400WithTheParameterNamed) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{", ""},
      {"[]", ""},
      {R"({"prompt":"a","max_tokens":0})", "max_tokens"},
      {R"({"prompt":"a","max_tokens":"5"})", "max_tokens"},
      {R"({"prompt":"a","temperature":3})", "temperature"},
      {R"({"prompt":"a","top_p":0})", "top_p"},
      {R"({"prompt":"a","top_k":-1})", "top_k"},
      {R"({"prompt":"a","stop":[1]})", "stop"},
      {R"({"prompt":"a","stream":"yes"})", "stream"},
      {R"({"prompt":"a","n":2})", "n"},
      {R"({"prompt":"a","model":5})", "model"},
      {R"({"prompt":[-1]})", "prompt"},
      {R"({"prompt":""})", "prompt"},
      {R"({"prompt":{}})", "prompt"},
      {R"({})", "prompt"},
  };
  for (const auto& [body, param] : bad) {
    try {
      parse_completion(body, Endpoint::Completion);
      ADD_FAILURE() << body << " was accepted";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400) << body;
      EXPECT_EQ(e.param, param) << body << ": " << e.what();
      EXPECT_EQ(e.body()["error"]["type"], "invalid_request_error");
    }
  }
  for (const char* body : {R"({"messages":[]})", R"({"messages":[{"content":"x"}]})",
                           R"({"messages":[{"role":"king","content":"x"}]})", R"({"messages":"hi"})",
                           R"({"messages":[{"role":"user","content":5}]})", R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":3})"})
    EXPECT_THROW(parse_completion(body, Endpoint::Chat), ApiError) << body;
  EXPECT_THROW(parse_detokenize(R"({"tokens":["a"]})"), ApiError);
  EXPECT_THROW(parse_tokenize(R"({"content":1})"), ApiError);
}

// Mutated valid bodies: each parses or throws ApiError with a 400; any other exception (or a crash) fails.
TEST(ServeRequest, RandomMutationsThrowOnlyApiErrors) {
  const std::vector<std::string> seeds = {
      R"({"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":5,"temperature":0,"stream":true,"stop":["a"],"logprobs":true,"top_logprobs":2,"seed":1})",
      R"({"prompt":[1,2,3],"max_tokens":4,"top_p":0.5,"top_k":2,"logprobs":1,"stream_options":{"include_usage":false}})",
      R"({"prompt":["text"],"n":1,"max_completion_tokens":3})"};
  const std::string alphabet = "{}[]\":,0123456789-.eE truefalsnul\\";
  std::mt19937 g(11);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string s = seeds[g() % seeds.size()];
    for (int k = 1 + static_cast<int>(g() % 4); k > 0; --k) {
      const size_t at = g() % (s.size() + 1);
      switch (g() % 3) {
        case 0: s.insert(at, 1, alphabet[g() % alphabet.size()]); break;
        case 1: if (at < s.size()) s.erase(at, 1); break;
        default: if (at < s.size()) s[at] = alphabet[g() % alphabet.size()];
      }
    }
    for (Endpoint ep : {Endpoint::Chat, Endpoint::Completion}) {
      try {
        parse_completion(s, ep);
        ++accepted;
      } catch (const ApiError& e) {
        ASSERT_EQ(e.status, 400) << s;
      } catch (const std::exception& e) {
        FAIL() << s << ": " << e.what();
      }
    }
  }
  EXPECT_GT(accepted, 100);
}

// Structured mutations: a field of a valid body (at the top or inside messages / stream_options) replaced by a value
// of every JSON type, big numbers and negative ones included. Each parses or is a 400 ApiError naming a parameter.
TEST(ServeRequest, EveryFieldOfEveryTypeIsAcceptedOrA400) {
  const nlohmann::json values = nlohmann::json::parse(
      R"([null, true, false, 0, -1, 1, 2.5, -3.5, 1e300, 18446744073709551615, -9223372036854775808, "", "x",
          [], [1], ["a"], [[1]], {}, {"a": 1}, [{"role": "user", "content": "c"}], {"type": "text", "text": "t"}])");
  const nlohmann::json base = nlohmann::json::parse(
      R"({"model":"m","messages":[{"role":"user","content":"hello"}],"prompt":"p","max_tokens":5,"temperature":0.5,
          "top_p":0.9,"top_k":3,"seed":1,"stop":["a"],"stream":true,"stream_options":{"include_usage":true},
          "logprobs":true,"top_logprobs":2,"n":1,"max_completion_tokens":4,"return_tokens":true,"ignore_eos":false,
          "tokens":[1,2],"content":"c","add_generation_prompt":true})");
  int checked = 0;
  for (const auto& [key, unused] : base.items()) {
    for (const auto& v : values) {
      for (int where = 0; where < 3; ++where) {
        nlohmann::json b = base;
        if (where == 0) b[key] = v;
        else if (where == 1) b["messages"][0][key == "model" ? "role" : "content"] = v;
        else b["stream_options"]["include_usage"] = v;
        const std::string body = b.dump();
        auto ok = [&](auto&& parse) {
          try {
            parse();
          } catch (const ApiError& e) {
            EXPECT_EQ(e.status, 400) << body;
          } catch (const std::exception& e) {
            ADD_FAILURE() << body << ": " << e.what();
          }
          ++checked;
        };
        ok([&] { parse_completion(body, Endpoint::Chat); });
        ok([&] { parse_completion(body, Endpoint::Completion); });
        ok([&] { parse_tokenize(body); });
        ok([&] { parse_detokenize(body); });
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace hs::serve
