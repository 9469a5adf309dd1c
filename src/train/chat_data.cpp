#include "train/chat_data.h"

#include <omp.h>
#include <unistd.h>

#include <atomic>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "chat/chat_template.h"
#include "dataset/token_file.h"
#include "dataset/vocabulary.h"
#include "tokenizer/tokenizer.h"

namespace hs::train {

bool is_chat_file(const std::string& path) { return std::filesystem::path(path).extension() == ".jsonl"; }

std::string ChatDataReport::summary() const {
  std::ostringstream s;
  s << written << " of " << lines << " conversations written (" << tokens << " tokens, " << loss_tokens
    << " in the loss; template " << template_origin << ")";
  if (dropped_long) s << "; " << dropped_long << " dropped as longer than the window (the longest " << longest_dropped << " tokens)";
  if (bad_lines) {
    s << "; " << bad_lines << " bad lines skipped";
    for (const auto& e : bad_examples) s << "\n  skipped: " << e;
  }
  if (without_loss) s << "; " << without_loss << " conversations have no token in the loss (no assistant turn)";
  return s.str();
}

ChatDataReport write_chat_tokens(const ChatDataOptions& o, const std::filesystem::path& out) {
  if (o.chat_template.empty())
    throw std::invalid_argument("--chat " + o.chat + ": no chat template to render it with: pass --chat-template FILE "
                                "(a .jinja file or tokenizer_config.json), or a checkpoint that carries one");
  if (o.tokenizer.empty())
    throw std::invalid_argument("--chat " + o.chat + ": no tokenizer: pass --tokenizer, or a checkpoint that carries one");
  const chat::ChatTemplate tmpl = chat::ChatTemplate::load(o.chat_template);
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::load(o.tokenizer);
  chat::JsonlResult in = chat::read_conversations(std::filesystem::path(o.chat), {o.skip_bad_lines});
  ChatDataReport r;
  r.template_origin = tmpl.origin();
  r.bad_lines = in.bad_lines;
  r.bad_examples = in.examples;
  r.lines = in.conversations.size();
  dataset::WriterOptions wo;
  wo.threads = o.threads;
  wo.separator_mask = o.loss_on == chat::LossOn::Assistant ? 0 : 1;
  std::optional<dataset::TokenFileWriter> w;
  w.emplace(out, dataset::vocabulary_of(tok), dataset::encoder_of(tok), wo);
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  const size_t n = in.conversations.size(), block = 256;
  for (size_t b0 = 0; b0 < n; b0 += block) {
    const size_t b1 = std::min(n, b0 + block);
    std::vector<chat::TokenizedConversation> t(b1 - b0);
    std::vector<std::string> error(b1 - b0);
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (size_t i = b0; i < b1; ++i) {
      try {
        t[i - b0] = chat::tokenize_conversation(tmpl, tok, in.conversations[i], o.loss_on);
      } catch (const std::exception& e) {
        error[i - b0] = e.what();
      }
    }
    for (size_t i = b0; i < b1; ++i) {
      const chat::Conversation& c = in.conversations[i];
      if (!error[i - b0].empty()) {
        const std::string msg = o.chat + ":" + std::to_string(c.line) + ": " + error[i - b0];
        if (!o.skip_bad_lines)
          throw std::invalid_argument(msg + " (fix the line, or pass --skip-bad-lines to skip such lines)");
        ++r.bad_lines;
        if (r.bad_examples.size() < 5) r.bad_examples.push_back(msg);
        continue;
      }
      const chat::TokenizedConversation& tc = t[i - b0];
      const int64_t len = static_cast<int64_t>(tc.ids.size());
      if (o.max_tokens > 0 && len > o.max_tokens) {
        ++r.dropped_long;
        r.longest_dropped = std::max(r.longest_dropped, len);
        continue;
      }
      int64_t counted = 0;
      for (uint8_t m : tc.loss_mask) counted += m != 0;
      if (counted == 0) ++r.without_loss;
      if (r.written > 0) {
        ++r.tokens;  // the separator
        r.loss_tokens += wo.separator_mask;
      }
      w->add_tokens(tc.ids, tc.loss_mask);
      r.tokens += len;
      r.loss_tokens += counted;
      ++r.written;
    }
    if (o.progress) o.progress(b1, n, r.tokens);
  }
  if (r.written == 0)
    throw std::invalid_argument("--chat " + o.chat + ": no conversation left to train on (" + std::to_string(r.lines) +
                                " read, " + std::to_string(r.dropped_long) + " longer than " +
                                std::to_string(o.max_tokens) + " tokens, " + std::to_string(r.bad_lines) +
                                " bad lines)" + (r.dropped_long ? ": raise --seq" : ""));
  w->commit();
  return r;
}

Tokens load_chat_tokens(const ChatDataOptions& o, const ModelVocabulary& model, ChatDataReport* report) {
  static std::atomic<int> counter{0};
  const std::filesystem::path tmp = std::filesystem::temp_directory_path() /
                                    ("hybridscan-chat-" + std::to_string(getpid()) + "-" +
                                     std::to_string(counter.fetch_add(1)) + ".tok");
  const ChatDataReport r = write_chat_tokens(o, tmp);
  Tokens t;
  try {
    t = load_tokens({tmp.string(), "", o.tokenizer}, model);
  } catch (...) {
    std::filesystem::remove(tmp);
    throw;
  }
  std::filesystem::remove(tmp);  // the mapping stays
  t.description = "chat file " + o.chat + " (" + r.summary() + ", loss on " + chat::loss_on_name(o.loss_on) +
                  "; rendered into a temporary token file)";
  if (report) *report = r;
  return t;
}

}  // namespace hs::train
