// tokenize: text files to a token file (docs/token_format.md) that train and eval memory-map with --data.
#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>

#include "cli/commands.h"
#include "cli/threads.h"
#include "core/memory.h"
#include "dataset/token_file.h"
#include "dataset/vocabulary.h"
#include "train/chat_data.h"
#include "train/data.h"

namespace hs::cli {

namespace {
struct TokenizeArgs {
    std::string tokenizer, out, chat, checkpoint, chat_template, loss_on = "assistant";
    std::vector<std::string> texts;
    bool raw = false, quiet = false, skip_bad_lines = false;
    int threads = 0;
    int64_t seq = 0;
};

// tokenize --chat: conversations to a token file with loss masks (train::write_chat_tokens).
void tokenize_chat(const TokenizeArgs& a, int threads) {
  if (a.raw) throw std::invalid_argument("--raw encodes a text; it does not apply to --chat");
  train::ChatDataOptions o;
  o.chat = a.chat;
  o.tokenizer = !a.tokenizer.empty() ? a.tokenizer
                : !a.checkpoint.empty() ? train::checkpoint_tokenizer(a.checkpoint)
                                         : "";
  if (o.tokenizer.empty())
    throw std::invalid_argument(a.checkpoint.empty() ? "tokenize --chat needs --checkpoint DIR or --tokenizer FILE"
                                                     : "checkpoint " + a.checkpoint +
                                                           " has no tokenizer.json: pass --tokenizer");
  o.chat_template = !a.chat_template.empty() ? a.chat_template : a.checkpoint;
  if (o.chat_template.empty())
    throw std::invalid_argument("tokenize --chat needs a chat template: --checkpoint DIR (its chat_template.jinja or "
                                "tokenizer_config.json) or --chat-template FILE");
  o.loss_on = chat::parse_loss_on(a.loss_on);
  o.skip_bad_lines = a.skip_bad_lines;
  o.max_tokens = a.seq;
  o.threads = threads;
  const bool tty = isatty(STDERR_FILENO);
  const auto t0 = std::chrono::steady_clock::now();
  const auto since = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  if (!a.quiet)
    o.progress = [&, tty](size_t done, size_t total, int64_t tokens) {
      if (total < 4096 && done < total) return;  // a line per block only on long files
      std::fprintf(stderr, "%stokenize: %zu / %zu conversations, %lld tokens, %.1f s%s", tty ? "\r\033[K" : "", done,
                   total, static_cast<long long>(tokens), since(), tty ? "" : "\n");
    };
  const train::ChatDataReport r = train::write_chat_tokens(o, a.out);
  if (!a.quiet && tty) std::fprintf(stderr, "\n");
  std::printf("wrote %s: %s, loss on %s, in %.2f s\n", a.out.c_str(), r.summary().c_str(), a.loss_on.c_str(), since());
}
}  // namespace

void register_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* c = app.add_subcommand(
      "tokenize", "Encode text files with a tokenizer (or conversations of a chat file, with their loss masks) into a token "
                  "file for 'train --data' and 'eval --data'");
  c->add_option("--tokenizer", a->tokenizer, "tokenizer.json, or a directory holding it (or vocab.json + merges.txt)")
      ->check(CLI::ExistingPath);
  auto* text_opt = c->add_option("--text", a->texts, "Text files, one document each, separated by the end-of-text token")
                   ->check(CLI::ExistingFile);
  c->add_option("--chat", a->chat,
                "Chat file (JSONL, one conversation a line, docs/chat.md): each conversation rendered with the chat "
                "template, tokenized and written as one document with its loss mask (a version-2 token file)")
      ->check(CLI::ExistingFile)
      ->excludes(text_opt);
  c->add_option("--checkpoint", a->checkpoint,
                "--chat: the checkpoint whose tokenizer.json and chat template are used (--tokenizer and "
                "--chat-template override them)")
      ->check(CLI::ExistingDirectory);
  c->add_option("--chat-template", a->chat_template, "--chat: a .jinja file or tokenizer_config.json to render with")
      ->check(CLI::ExistingPath);
  c->add_option("--loss-on", a->loss_on,
                "--chat: assistant (the assistant turns and their end-of-turn token, docs/chat.md) | all")
      ->check(CLI::IsMember({"assistant", "all"}))
      ->capture_default_str();
  c->add_flag("--skip-bad-lines", a->skip_bad_lines,
              "--chat: skip (count and report) malformed lines instead of stopping at the first one");
  c->add_option("--seq", a->seq,
                "--chat: drop (count and report) conversations of more than N tokens, which a training window of "
                "--seq N never sees whole (0: keep all)")
      ->capture_default_str();
  c->add_option("--out", a->out, "Token file to write (replaced atomically)")->required();
  c->add_flag("--raw", a->raw,
              "Debugging: the ids of one file encoded as one string (no special tokens added), as plain "
              "little-endian uint32 without a header");
  add_threads_option(c, a->threads, "Encoding threads (0: all cores)");
  c->add_flag("--quiet", a->quiet, "No progress line");
  c->callback([a] {
    const int threads = a->threads > 0 ? a->threads : omp_get_max_threads();
    if (!a->chat.empty()) return tokenize_chat(*a, threads);
    if (a->texts.empty()) throw std::invalid_argument("tokenize needs --text FILE... or --chat FILE.jsonl");
    if (a->tokenizer.empty()) throw std::invalid_argument("tokenize --text needs --tokenizer");
    const auto t0 = std::chrono::steady_clock::now();
    const tokenizer::Tokenizer tok = tokenizer::Tokenizer::load(a->tokenizer);
    const auto since = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    const double load_s = since();  // tokens/s counts the encoding only
    if (a->raw) {
      if (a->texts.size() != 1) throw std::invalid_argument("--raw encodes exactly one --text file");
      std::ifstream f(a->texts[0], std::ios::binary);
      if (!f) throw std::runtime_error("cannot read text file '" + a->texts[0] + "'");
      const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      const std::vector<tokenizer::TokenId> ids = tok.encode_parallel(text, threads);
      dataset::write_raw_tokens(a->out, ids);
      std::printf("wrote %s: %zu ids (raw little-endian uint32) from %zu bytes in %.2f s\n", a->out.c_str(), ids.size(),
                  text.size(), since() - load_s);
      return;
    }
    dataset::WriterOptions wo;
    wo.threads = threads;
    for (const auto& t : a->texts) wo.bytes_total += std::filesystem::file_size(t);
    const bool tty = isatty(STDERR_FILENO);
    if (!a->quiet)
      wo.progress = [tty](const dataset::WriteProgress& p) {
        const double pct = p.bytes_total ? 100.0 * double(p.bytes_done) / double(p.bytes_total) : 0.0;
        std::fprintf(stderr, "%stokenize: %s / %s (%.0f%%), %lld tokens, %.2f MB/s%s", tty ? "\r\033[K" : "",
                     format_bytes(double(p.bytes_done)).c_str(), format_bytes(double(p.bytes_total)).c_str(), pct,
                     static_cast<long long>(p.tokens), p.seconds > 0 ? double(p.bytes_done) / p.seconds / 1e6 : 0.0,
                     tty ? "" : "\n");
      };
    dataset::TokenFileWriter w(a->out, dataset::vocabulary_of(tok), dataset::encoder_of(tok), wo);
    for (const auto& t : a->texts) w.add_text_file(t);
    const dataset::TokenFileHeader h = w.commit();
    if (!a->quiet && tty) std::fprintf(stderr, "\n");
    const double s = since() - load_s;
    std::printf("wrote %s: %lld tokens (uint%u), %lld documents, %lld bytes of text (%.2f bytes/token) in %.2f s on %d "
                "threads (tokenizer loaded in %.2f s before): %.0f tokens/s, %.2f MB/s\n",
                a->out.c_str(), static_cast<long long>(h.tokens), h.dtype_bytes * 8, static_cast<long long>(h.documents),
                static_cast<long long>(h.text_bytes), h.tokens ? double(h.text_bytes) / double(h.tokens) : 0.0, s,
                threads, load_s, s > 0 ? double(h.tokens) / s : 0.0, s > 0 ? double(h.text_bytes) / s / 1e6 : 0.0);
  });
}

}  // namespace hs::cli
