// Rendering speed of the chat-template renderer (src/chat): every case of a tests/chat_reference.py output file
// (the generated conversations of the real Qwen templates) rendered REPS times; prints one JSON line per template with
// the best pass's conversations/s and output MB/s. Loading and parsing the JSON are never timed.
//   chat_render CASES.jsonl TEMPLATE_DIR REPS
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "chat/chat_template.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: chat_render CASES.jsonl TEMPLATE_DIR REPS\n";
    return 2;
  }
  std::ifstream in(argv[1]);
  std::map<std::string, std::vector<nlohmann::ordered_json>> cases;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::ordered_json::parse(line);
    if (!j.contains("source") && j.contains("rendered"))
      cases[j["template"].get<std::string>()].push_back(std::move(j));
  }
  const int reps = std::max(1, std::atoi(argv[3]));
  for (const auto& [name, list] : cases) {
    const auto t = hs::chat::ChatTemplate::load(std::string(argv[2]) + "/" + name);
    double best = 1e30;
    size_t bytes = 0;
    for (int r = 0; r <= reps; ++r) {  // the first pass warms up
      bytes = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& c : list) {
        hs::chat::RenderOptions opt;
        opt.add_generation_prompt = c["add_generation_prompt"].get<bool>();
        bytes += t.render(c["messages"], opt, c["tools"], c["extra"]).size();
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) best = std::min(best, s);
    }
    std::printf("{\"template\": \"%s\", \"conversations\": %zu, \"per_s\": %.1f, \"mb_per_s\": %.2f}\n", name.c_str(),
                list.size(), list.size() / best, bytes / best / 1e6);
  }
  return 0;
}
