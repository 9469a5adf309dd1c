// generate: text from a checkpoint (native or Hugging Face) through the incremental decoder (src/infer).
#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "chat/chat_template.h"
#include "checkpoint/convert.h"
#include "cli/commands.h"
#include "cli/gguf_options.h"
#include "cli/speculative_options.h"
#include "cli/step_options.h"
#include "cli/threads.h"
#include "core/memory.h"
#include "gguf/import.h"
#include "infer/generate.h"
#include "infer/policy.h"
#include "infer/speculative.h"
#include "infer/weights.h"
#include "tokenizer/tokenizer.h"
#include "train/schedule.h"

namespace hs::cli {

namespace {

// How idle OpenMP threads wait in this process (chosen in main.cpp from the machine's load, or set by the user):
// "spin N" (GOMP_SPINCOUNT, then sleep), "passive" (sleep at once), "active", or "default".
std::string thread_wait() {
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  if (spin && *spin) return std::string("spin ") + spin;
  return policy && *policy ? policy : "default";
}

struct GenerateArgs {
  std::string checkpoint, prompt, prompts_file, weight_dtype, weights_memory = "auto", chat_template, system;
  std::vector<std::string> prompt_ids;  // one prompt each
  int64_t max_new_tokens = 128, top_k = 0, prefill_piece = infer::GenerateOptions{}.piece;
  int threads = 0;
  double temperature = 0, top_p = 1;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool chat = false, json = false, ignore_eos = false;
  GgufArgs gguf;
  SpeculativeArgs spec;  // --speculative, --draft
  bool compare_plain = false;
};

std::vector<int32_t> parse_ids(const std::string& text, int64_t vocab) {
  std::vector<int32_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || item.find_first_not_of(" \t", used) != std::string::npos)
      throw std::invalid_argument("--prompt-ids: '" + item + "' is not an integer");
    if (v < 0 || v >= vocab)
      throw std::invalid_argument("--prompt-ids: id " + std::to_string(v) + " is outside the vocabulary [0, " +
                                  std::to_string(vocab) + ")");
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) throw std::invalid_argument("--prompt-ids: no ids");
  return ids;
}

void run_generate(const GenerateArgs& a) {
  const int given = !a.prompt.empty() + !a.prompt_ids.empty() + !a.prompts_file.empty();
  if (given != 1) throw std::invalid_argument("give exactly one of --prompt, --prompt-ids, --prompts");
  apply_threads(a.threads);
  if (a.max_new_tokens <= 0)
    throw std::invalid_argument("--max-new-tokens must be positive (got " + std::to_string(a.max_new_tokens) + ")");
  if (a.temperature < 0) throw std::invalid_argument("--temperature must be >= 0");
  if (a.top_p <= 0 || a.top_p > 1) throw std::invalid_argument("--top-p must be in (0, 1]");
  if (a.top_k < 0) throw std::invalid_argument("--top-k must be >= 0");
  const int64_t draft = speculative_draft(a.spec);
  if (draft == 0 && a.compare_plain) throw std::invalid_argument("--compare-plain needs --speculative mtp");

  std::vector<std::string> needs_dequantized;
  if (draft > 0) needs_dequantized.push_back("--speculative mtp");
  if (!a.weight_dtype.empty()) needs_dequantized.push_back("--weight-dtype " + a.weight_dtype);
  const bool blocks = gguf_from_blocks(a.gguf, a.checkpoint, needs_dequantized, "generate");
  // A .gguf file is imported for the run: its configuration and tokenizer, and its tensors unless they are used from
  // its blocks.
  const gguf::CheckpointPath source(a.checkpoint, blocks ? gguf::CheckpointPath::Weights::FromBlocks
                                                         : gguf::CheckpointPath::Weights::Dequantized);
  checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(source.path());
  const model::ModelConfig& cfg = d.config;
  if (draft > 0 && cfg.mtp_layers < 1)
    throw std::invalid_argument("--speculative mtp: checkpoint " + a.checkpoint + " has no multi-token-prediction "
                                "layer (mtp.*; num_nextn_predict_layers / mtp_num_hidden_layers is 0): train one from a "
                                "'+mtp' preset (e.g. --preset small+mtp --mtp-weight 0.3), or decode without "
                                "--speculative");
  // Text goes through the checkpoint's tokenizer.json when it has one, else it is bytes (the byte-level presets,
  // vocabulary 256).
  std::optional<tokenizer::Tokenizer> tok;
  if (std::filesystem::exists(d.path / "tokenizer.json")) tok = tokenizer::Tokenizer::load((d.path / "tokenizer.json").string());
  const bool bytes_vocab = !tok && cfg.vocab == 256;
  auto check_ids = [&](const std::vector<int32_t>& ids) {
    for (int32_t id : ids)
      if (id < 0 || id >= cfg.vocab)
        throw std::invalid_argument("the prompt's token " + std::to_string(id) + " is outside the model's vocabulary of " +
                                    std::to_string(cfg.vocab) + " (a tokenizer that does not belong to the model?)");
    return ids;
  };
  // --chat: the prompt is one user turn (after a --system one) rendered by the checkpoint's own chat template, as
  // transformers' apply_chat_template(add_generation_prompt=True) renders it. No template, no guess: a base model or
  // one trained on another format would be given a format it never saw (docs/chat.md).
  const bool chat = a.chat || !a.chat_template.empty();
  std::optional<chat::ChatTemplate> chat_template;
  if (chat) try {
      const std::filesystem::path from = a.chat_template.empty() ? d.path : std::filesystem::path(a.chat_template);
      chat_template = chat::ChatTemplate::load(from);
    } catch (const std::exception& e) {
      throw std::invalid_argument(std::string("--chat: ") + e.what() +
                                  (a.chat_template.empty() ? " (or name one with --chat-template FILE)" : ""));
    }
  auto chat_prompt = [&](const std::string& text) {
    nlohmann::json messages = nlohmann::json::array();
    if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
    messages.push_back({{"role", "user"}, {"content", text}});
    chat::RenderOptions opt;
    opt.add_generation_prompt = true;
    try {
      return chat_template->render(messages, opt);
    } catch (const std::exception& e) {
      throw std::invalid_argument(std::string("--chat: ") + e.what());
    }
  };
  auto text_ids = [&](const std::string& text) {
    if (text.empty()) throw std::invalid_argument("an empty prompt");
    const std::string wrapped = chat ? chat_prompt(text) : text;
    if (tok) {
      const std::vector<tokenizer::TokenId> ids = tok->encode(wrapped);
      return check_ids(std::vector<int32_t>(ids.begin(), ids.end()));
    }
    if (!bytes_vocab)
      throw std::invalid_argument("checkpoint " + a.checkpoint + " has no tokenizer.json and a vocabulary of " +
                                  std::to_string(cfg.vocab) + " (not bytes): give --prompt-ids");
    return std::vector<int32_t>(reinterpret_cast<const unsigned char*>(wrapped.data()),
                                reinterpret_cast<const unsigned char*>(wrapped.data()) + wrapped.size());
  };
  if (!a.system.empty() && !chat) throw std::invalid_argument("--system needs --chat");

  std::vector<std::vector<int32_t>> prompts;
  if (!a.prompt.empty()) prompts.push_back(text_ids(a.prompt));
  for (const std::string& ids : a.prompt_ids) prompts.push_back(parse_ids(ids, cfg.vocab));
  if (!a.prompts_file.empty()) {
    std::ifstream in(a.prompts_file);
    if (!in) throw std::invalid_argument("cannot read --prompts file " + a.prompts_file);
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) prompts.push_back(text_ids(line));
    if (prompts.empty()) throw std::invalid_argument("--prompts file " + a.prompts_file + " holds no prompt");
  }
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  infer::GenerateOptions opt;
  opt.max_new_tokens = infer::new_token_budget(a.max_new_tokens, infer::model_context(d.config_json), longest);
  opt.sampling = {a.temperature, a.top_k, a.top_p, a.seed};
  if (a.prefill_piece <= 0) throw std::invalid_argument("--prefill-piece must be positive");
  opt.piece = a.prefill_piece;
  if (!a.ignore_eos) opt.stop_ids = infer::end_ids(d.config_json, tok ? &*tok : nullptr);

  // Weights in their stored dtype unless --weight-dtype converts them (memory-mapped when they can be used in
  // place); compute in the same dtype, so no layer casts its weights per token.
  MemoryAccountant mem;
  std::unique_ptr<infer::InferenceWeights> weights =
      blocks ? infer::load_gguf_weights(a.checkpoint, mem)
                    : infer::load_weights(d, a.weight_dtype.empty() ? std::nullopt
                                                                    : std::optional<DType>(parse_dtype(a.weight_dtype)),
                                          mem, infer::parse_weights_memory(a.weights_memory));
  if (weights->quant) opt.quant = weights->quant.get();
  for (const auto& n : weights->notes) std::fprintf(stderr, "generate: %s\n", n.c_str());
  if (weights->memory == infer::WeightsMemory::Copy)
    std::fprintf(stderr, "generate: weights copied into memory (--weights-memory %s): %s\n", a.weights_memory.c_str(),
                 format_bytes(double(weights->copied_bytes)).c_str());
  const model::ParamSet& params = *weights->params;
  const DType wdt = opt.quant ? DType::F32 : params.global(model::g::kLmHead).dtype;  // (quantized: fp32 compute)
  opt.compute = wdt;
  if (wdt == DType::BF16) note_bf16_widening("generate");

  // Streams the single prompt's text; several prompts print at the end. Stop strings end a sequence once its text
  // holds one (the text is cut before it).
  std::vector<std::string> texts(prompts.size());
  std::vector<tokenizer::StreamDecoder> decoders;
  std::vector<char> cut(prompts.size(), 0);  // ended by a stop string: nothing follows the cut
  if (tok)
    for (size_t i = 0; i < prompts.size(); ++i) decoders.emplace_back(*tok, /*skip_special_tokens=*/true);
  const bool stream = prompts.size() == 1;
  auto on_token = [&](size_t i, int32_t id) {
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), id) != opt.stop_ids.end()) return false;
    std::string piece = tok           ? decoders[i].push(static_cast<tokenizer::TokenId>(id))
                        : bytes_vocab ? std::string(1, static_cast<char>(id))
                                      : "<" + std::to_string(id) + ">";
    const size_t old = texts[i].size();
    texts[i] += piece;
    for (const std::string& s : a.stop) {
      const size_t at = texts[i].find(s, old >= s.size() ? old - s.size() + 1 : 0);
      if (!s.empty() && at != std::string::npos) {
        if (stream && at > old) std::fwrite(texts[i].data() + old, 1, at - old, stdout);
        texts[i].resize(at);
        cut[i] = 1;
        return false;
      }
    }
    if (stream) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
    return true;
  };
  infer::SpeculativeStats spec;
  infer::GenerateResult r = draft > 0 ? infer::generate_speculative(params, prompts, opt, draft, mem, on_token, &spec)
                                      : infer::generate(params, prompts, opt, mem, on_token);
  for (size_t i = 0; i < decoders.size(); ++i) {  // bytes of a character the last token left incomplete
    if (cut[i]) continue;
    const std::string rest = decoders[i].finish();
    texts[i] += rest;
    if (stream) std::fwrite(rest.data(), 1, rest.size(), stdout);
  }
  if (stream) std::printf("\n");
  else
    for (size_t i = 0; i < texts.size(); ++i) std::printf("[%zu] %s\n", i, texts[i].c_str());
  const double prefill_tps = r.prefill_seconds > 0 ? double(r.prefill_tokens) / r.prefill_seconds : 0;
  const double decode_tps = r.decode_seconds > 0 ? double(r.decode_tokens) / r.decode_seconds : 0;
  const size_t rss = peak_resident_bytes();
  std::fprintf(stderr, "generate: prefill %lld tokens at %.1f tokens/s, decode %lld tokens at %.1f tokens/s, "
                       "caches %s, peak RSS %s\n",
               (long long)r.prefill_tokens, prefill_tps, (long long)r.decode_tokens, decode_tps,
               format_bytes(double(r.kv_cache_bytes + r.recurrent_state_bytes)).c_str(), format_bytes(double(rss)).c_str());
  // Speculative decoding: acceptance per draft position, and with --compare-plain plain decoding of the same
  // prompts in the same run (its tokens/s and, greedy, whether the tokens are the same).
  nlohmann::json spec_json;
  if (draft > 0) {
    std::string per;
    nlohmann::json rates = nlohmann::json::array();
    for (size_t k = 0; k < spec.accepted.size(); ++k) {
      const double rate = spec.steps ? double(spec.accepted[k]) / double(spec.steps) : 0;
      rates.push_back(rate);
      char buf[64];
      std::snprintf(buf, sizeof buf, "%s%zu: %.1f%%", k ? ", " : "", k + 1, 100 * rate);
      per += buf;
    }
    const double per_step = spec.steps ? double(spec.emitted) / double(spec.steps) : 0;
    std::fprintf(stderr, "speculative: mtp, draft %lld: %lld verification steps, %.2f tokens per step; drafts kept "
                         "(position: share of steps) %s; draft %.3f s, verify %.3f s\n",
                 (long long)draft, (long long)spec.steps, per_step, per.c_str(), spec.draft_seconds, spec.verify_seconds);
    spec_json = {{"draft", draft}, {"steps", spec.steps}, {"accepted_rate", rates}, {"tokens_per_step", per_step}};
    if (a.compare_plain) {
      MemoryAccountant mem2;
      infer::GenerateOptions o2 = opt;
      infer::GenerateResult plain = infer::generate(params, prompts, o2, mem2);
      const double plain_tps = plain.decode_seconds > 0 ? double(plain.decode_tokens) / plain.decode_seconds : 0;
      const double tps = r.decode_seconds > 0 ? double(r.decode_tokens) / r.decode_seconds : 0;
      const bool same = plain.tokens == r.tokens;
      std::fprintf(stderr, "speculative: plain decode in the same run: %.1f tokens/s, speculative %.1f tokens/s: "
                           "speedup %.2fx; tokens %s plain decoding's%s\n",
                   plain_tps, tps, plain_tps > 0 ? tps / plain_tps : 0, same ? "equal" : "differ from",
                   opt.sampling.temperature > 0 ? " (sampled: they need not)" : "");
      spec_json["plain_decode_tokens_per_s"] = plain_tps;
      spec_json["speedup"] = plain_tps > 0 ? tps / plain_tps : 0;
      spec_json["same_tokens_as_plain"] = same;
    }
  }
  if (a.json) {
    nlohmann::json text = nlohmann::json::array();
    for (const auto& t : texts) text.push_back(t);
    std::printf("%s\n", nlohmann::json({{"tokens", r.tokens}, {"text", text}, {"prefill_tokens_per_s", prefill_tps},
                                        {"decode_tokens_per_s", decode_tps}, {"peak_rss_bytes", rss},
                                        {"kv_cache_bytes", r.kv_cache_bytes},
                                        {"recurrent_state_bytes", r.recurrent_state_bytes},
                                        {"accounted_peak_bytes", r.peak_bytes},
                                        {"weights_bytes", params.nbytes()}, {"weights_mapped", weights->mapped},
                                        {"weights_memory", infer::weights_memory_name(weights->memory)},
                                        {"weights_mapped_bytes", weights->mapped_bytes},
                                        {"weights_copied_bytes", weights->copied_bytes},
                                        {"thread_wait", thread_wait()}, {"speculative", spec_json}})
                            .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                            .c_str());
  }
}

}  // namespace

void register_generate(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* c = app.add_subcommand("generate", "Generate text from a checkpoint (native or Hugging Face)");
  c->add_option("--checkpoint", a->checkpoint, "Checkpoint directory or .gguf file")->required()->check(CLI::ExistingPath);
  c->add_option("--prompt", a->prompt, "Prompt text (bytes for the byte-level presets)");
  c->add_option("--prompt-ids", a->prompt_ids, "Prompt as token ids, e.g. 1,2,3 (repeat for several prompts)");
  c->add_option("--prompts", a->prompts_file, "File of prompts, one a line, generated together");
  c->add_option("--max-new-tokens", a->max_new_tokens, "Tokens to generate per prompt")->capture_default_str();
  c->add_option("--temperature", a->temperature, "0: greedy")->capture_default_str();
  c->add_option("--top-k", a->top_k, "Sample among the k most likely (0: all)")->capture_default_str();
  c->add_option("--top-p", a->top_p, "Sample among the most likely up to this probability")->capture_default_str();
  c->add_option("--seed", a->seed, "Sampling seed (prompt i uses seed + i)")->capture_default_str();
  c->add_option("--stop", a->stop, "End a sequence when its text holds this string (repeatable)");
  add_dtype_option(c, "--weight-dtype", a->weight_dtype, "Convert the weights at load: fp32 | bf16 (default: as stored)");
  add_gguf_options(c, a->gguf);
  c->add_option("--weights-memory", a->weights_memory,
                "Where the weights live: map (used in place from the files' memory mapping where they can be: page "
                "cache, 4 KiB pages, outside the accountant), copy (all but the embedding table read once into "
                "huge-page memory of the engine's own, in the same dtype: faster decode, the files' pages are "
                "dropped), auto (copy when the weights "
                "plus 1 GiB take at most half of the available memory, else map)")
      ->check(CLI::IsMember({"map", "copy", "auto"}))
      ->capture_default_str();
  c->add_option("--prefill-piece", a->prefill_piece,
                "Prompt tokens per prefill pass (serve prefills in pieces of 64: the same bits as serve's answers)")
      ->capture_default_str();
  c->add_flag("--chat", a->chat,
              "Render each prompt as a user turn with the checkpoint's chat template (chat_template.jinja, or "
              "tokenizer_config.json's chat_template), ending where the assistant's answer begins");
  c->add_option("--chat-template", a->chat_template,
                "A chat template (.jinja file, or a directory holding one) instead of the checkpoint's; implies --chat")
      ->check(CLI::ExistingPath);
  c->add_option("--system", a->system, "With --chat: a system turn before each prompt");
  c->add_flag("--ignore-eos", a->ignore_eos,
              "Do not end on end-of-text / <|im_end|> ids: always --max-new-tokens (benchmarks)");
  add_speculative_options(c, a->spec);
  c->add_flag("--compare-plain", a->compare_plain,
              "With --speculative: also decode the prompts plainly in the same run and report the speedup and "
              "whether the tokens are the same");
  add_threads_option(c, a->threads);
  c->add_flag("--json", a->json, "End with one JSON line: tokens, text, tokens/s, peak RSS");
  c->callback([a] { run_generate(*a); });
}

}  // namespace hs::cli
