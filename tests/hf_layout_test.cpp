#include <gtest/gtest.h>

#include <set>

#include "checkpoint/hf_layout.h"

namespace hs::checkpoint {
namespace {

model::ModelConfig cfg(model::Family f, int64_t L) {
  model::ModelConfig c = model::preset("tiny");
  c.family = f;
  c.layers = L;
  c.k_heads = 2;
  c.v_heads = 6;  // r = 3: the interleave regroups v and z by value head
  return c;
}

// Runs are a bijection: every element of every stacked tensor is the image of exactly one element of exactly one HF
// tensor, and every HF tensor is covered exactly once, in offset order.
TEST(HfLayout, RunsAreABijection) {
  for (auto fam : {model::Family::Qwen3Next, model::Family::Qwen3_5})
    for (auto ex : {ExpertLayout::PerExpert, ExpertLayout::Fused})
      for (int64_t L : {4, 5, 6, 7, 8}) {
        HfLayout lay = hf_layout(cfg(fam, L), ex);
        std::vector<std::vector<int>> hits(lay.stacked.size());
        for (size_t i = 0; i < lay.stacked.size(); ++i) hits[i].assign(size_t(numel(lay.stacked[i].shape)), 0);
        std::set<std::string> names;
        for (const HfTensor& t : lay.hf) {
          EXPECT_TRUE(names.insert(t.name).second) << "duplicate " << t.name;
          int64_t at = 0;
          for (const ElementRun& r : t.runs) {
            EXPECT_EQ(r.hf_at, at) << t.name;
            at += r.count;
            for (int64_t j = 0; j < r.count; ++j) ++hits[r.stacked][size_t(r.stacked_at + j)];
          }
          EXPECT_EQ(at, numel(t.shape)) << t.name;
        }
        for (size_t i = 0; i < hits.size(); ++i)
          for (size_t j = 0; j < hits[i].size(); ++j)
            ASSERT_EQ(hits[i][j], 1) << lay.stacked[i].name << "[" << j << "] L=" << L;
      }
}

TEST(HfLayout, NamesFollowEachFamily) {
  HfLayout next = hf_layout(cfg(model::Family::Qwen3Next, 5), ExpertLayout::PerExpert);
  HfLayout q35 = hf_layout(cfg(model::Family::Qwen3_5, 5), ExpertLayout::Fused);
  auto has = [](const HfLayout& l, const std::string& n) {
    for (const auto& t : l.hf)
      if (t.name == n) return true;
    return false;
  };
  EXPECT_TRUE(has(next, "model.layers.0.linear_attn.in_proj_qkvz.weight"));
  EXPECT_TRUE(has(next, "model.layers.0.linear_attn.in_proj_ba.weight"));
  EXPECT_TRUE(has(next, "model.layers.3.mlp.experts.2.up_proj.weight"));
  EXPECT_TRUE(has(next, "model.layers.4.linear_attn.A_log"));  // the remainder layer
  EXPECT_FALSE(has(next, "model.layers.0.linear_attn.in_proj_z.weight"));
  EXPECT_TRUE(has(q35, "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"));
  EXPECT_TRUE(has(q35, "model.language_model.layers.3.self_attn.q_proj.weight"));
  EXPECT_TRUE(has(q35, "model.language_model.layers.3.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(has(q35, "lm_head.weight"));
  EXPECT_FALSE(has(q35, "model.language_model.layers.4.self_attn.q_proj.weight"));  // remainder is linear
}

// Known values: HF element (layer i, expert e, half h, row j) lands at stacked [block][local][e][h*I + j].
TEST(HfLayout, PerExpertGateUpLandsOnTheRightAxes) {
  model::ModelConfig c = cfg(model::Family::Qwen3Next, 8);
  HfLayout lay = hf_layout(c, ExpertLayout::PerExpert);
  const int64_t I = c.expert_inter, H = c.hidden, E = c.experts;
  for (const HfTensor& t : lay.hf) {
    for (int64_t i = 0; i < c.layers; ++i)
      for (int64_t e = 0; e < E; ++e)
        for (int half = 0; half < 2; ++half) {
          std::string n = "model.layers." + std::to_string(i) + ".mlp.experts." + std::to_string(e) +
                          (half ? ".up_proj.weight" : ".gate_proj.weight");
          if (t.name != n) continue;
          ASSERT_EQ(t.runs.size(), 1u);
          const bool full = (i + 1) % 4 == 0;
          const int64_t block = i / 4, local = i % 4;
          EXPECT_EQ(lay.stacked[t.runs[0].stacked].name,
                    std::string(full ? "global" : "local") + ".mlp.experts.gate_up_proj");
          const int64_t layer_index = full ? block : block * 3 + local;
          EXPECT_EQ(t.runs[0].stacked_at, ((layer_index * E + e) * 2 * I + half * I) * H) << n;
        }
  }
}

}  // namespace
}  // namespace hs::checkpoint
