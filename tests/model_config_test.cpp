#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/params.h"

namespace hs::model {

TEST(ModelConfig, PresetsValidateAndCountParameters) {
  for (const auto& n : preset_names()) EXPECT_NO_THROW(preset(n).validate()) << n;
  // The released sizes in their names (total parameters, MTP head excluded): within 3%.
  EXPECT_NEAR(preset("qwen3-next-80b-a3b").parameter_count() / 1e9, 80.0, 80.0 * 0.03);
  EXPECT_NEAR(preset("qwen3.5-35b-a3b").parameter_count() / 1e9, 35.0, 35.0 * 0.03);
  EXPECT_NEAR(preset("qwen3.5-397b-a17b").parameter_count() / 1e9, 397.0, 397.0 * 0.03);
  EXPECT_THROW(preset("qwen9"), std::invalid_argument);
}

TEST(ModelConfig, ParameterCountMatchesAllocatedParameters) {
  for (const char* n : {"tiny", "small", "tiny+mtp", "small+mtp", "qwen3.5-tiny+mtp"}) {
    ModelConfig c = preset(n);
    for (int64_t L : {4, 5, 6, 7}) {
      c.layers = L;
      MemoryAccountant plan(true);
      ParamSet ps(c, DType::F32, plan, MemCategory::Parameters, false);
      EXPECT_EQ(ps.numel(), c.parameter_count()) << n << " L=" << L;
    }
  }
}

TEST(ModelConfig, HuggingFaceJsonRoundTripBothFamilies) {
  for (const char* n : {"qwen3-next-80b-a3b", "qwen3.5-397b-a17b"}) {
    ModelConfig c = preset(n);
    ModelConfig back = config_from_hf_json(config_to_hf_json(c));
    EXPECT_EQ(back.family, c.family);
    EXPECT_EQ(back.hidden, c.hidden);
    EXPECT_EQ(back.layers, c.layers);
    EXPECT_EQ(back.v_heads, c.v_heads);
    EXPECT_EQ(back.experts, c.experts);
    EXPECT_EQ(back.vocab, c.vocab);
    EXPECT_EQ(back.rotary_dim(), 64);
    EXPECT_DOUBLE_EQ(back.rope_theta, 1e7);
    EXPECT_EQ(back.parameter_count(), c.parameter_count());
  }
}

// The MTP layer: each family's field name (num_nextn_predict_layers, text_config.mtp_num_hidden_layers) read and
// written, "+mtp" presets, its parameters counted (fc 2H^2, three norms, one full-attention layer with the FFN), and
// the values the engine cannot run refused with the field's name.
TEST(ModelConfig, MtpLayerFieldsOfBothFamilies) {
  for (const char* n : {"qwen3-next-80b-a3b", "qwen3.5-397b-a17b"}) {
    ModelConfig c = preset(n);
    EXPECT_EQ(c.mtp_layers, 0) << n;
    EXPECT_EQ(config_from_hf_json(config_to_hf_json(c)).mtp_layers, 0) << n;
    c.mtp_layers = 1;
    nlohmann::json j = config_to_hf_json(c);
    const nlohmann::json& t = c.family == Family::Qwen3Next ? j : j.at("text_config");
    EXPECT_EQ(t.at(c.family == Family::Qwen3Next ? "num_nextn_predict_layers" : "mtp_num_hidden_layers"), 1) << n;
    ModelConfig back = config_from_hf_json(j);
    EXPECT_EQ(back.mtp_layers, 1) << n;
    EXPECT_EQ(back.parameter_count(), c.parameter_count()) << n;
    EXPECT_GT(c.mtp_parameter_count(), 2 * c.hidden * c.hidden) << n;
    nlohmann::json bad = j;
    (c.family == Family::Qwen3Next ? bad : bad["text_config"])[c.family == Family::Qwen3Next ? "num_nextn_predict_layers"
                                                                                              : "mtp_num_hidden_layers"] = 2;
    EXPECT_THROW(config_from_hf_json(bad), std::invalid_argument) << n;
  }
  nlohmann::json dedicated = config_to_hf_json(preset("qwen3.5-tiny+mtp"));
  dedicated["text_config"]["mtp_use_dedicated_embeddings"] = true;
  EXPECT_THROW(config_from_hf_json(dedicated), std::invalid_argument);
  const ModelConfig t = preset("tiny"), m = preset("tiny+mtp");
  EXPECT_EQ(m.mtp_layers, 1);
  EXPECT_EQ(load_config("small+mtp").mtp_layers, 1);
  // tiny: H 64, attention 4q/2kv x 16 (q 8192, k 2048, v 2048, o 4096, q/k norms 32), MoE 4 x (3 x 32 x 64) + router
  // 256 + shared 3 x 32 x 64 + gate 64, two layer norms 128; fc 8192 and three norms 192.
  EXPECT_EQ(m.mtp_parameter_count(), 8192 + 192 + (8192 + 2048 + 2048 + 4096 + 32) + 128 +
                                         (4 * 3 * 32 * 64 + 256 + 3 * 32 * 64 + 64));
  EXPECT_EQ(m.parameter_count() - t.parameter_count(), m.mtp_parameter_count());
  EXPECT_THROW(preset("tiny+mtp+mtp"), std::invalid_argument);
  EXPECT_THROW(preset("nope+mtp"), std::invalid_argument);
}

// A config.json without partial_rotary_factor rotates what transformers rotates: a quarter of the head (its default
// for both families), not the whole head.
TEST(ModelConfig, AbsentPartialRotaryFactorIsTransformersDefault) {
  for (const char* n : {"qwen3-next-80b-a3b", "qwen3.5-35b-a3b"}) {
    nlohmann::json j = config_to_hf_json(preset(n));
    for (nlohmann::json* t : {&j, j.contains("text_config") ? &j["text_config"] : &j}) {
      t->erase("partial_rotary_factor");
      if (t->contains("rope_parameters")) (*t)["rope_parameters"].erase("partial_rotary_factor");
    }
    const ModelConfig c = config_from_hf_json(j);
    EXPECT_DOUBLE_EQ(c.partial_rotary, 0.25) << n;
    EXPECT_EQ(c.rotary_dim(), c.head_dim / 4) << n;
  }
}

TEST(ModelConfig, DenseQwen35AndErrors) {
  nlohmann::json j = config_to_hf_json(preset("qwen3.5-35b-a3b"));
  auto& t = j["text_config"];
  t.erase("num_experts");
  t["intermediate_size"] = 1024;
  ModelConfig dense = config_from_hf_json(j);
  EXPECT_FALSE(dense.moe());
  EXPECT_EQ(dense.intermediate, 1024);

  nlohmann::json bad = config_to_hf_json(preset("qwen3.5-35b-a3b"));
  bad["text_config"]["layer_types"][0] = "full_attention";
  EXPECT_THROW(config_from_hf_json(bad), std::invalid_argument);
  bad = config_to_hf_json(preset("qwen3.5-35b-a3b"));
  bad["text_config"]["linear_num_value_heads"] = 33;
  try {
    config_from_hf_json(bad);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("linear_num_value_heads"), std::string::npos) << e.what();
  }
  bad = config_to_hf_json(preset("tiny"));
  bad["model_type"] = "llama";
  EXPECT_THROW(config_from_hf_json(bad), std::invalid_argument);
}

TEST(StackedLayout, SlotsAreTheInverseOfLayerIndicesAndTypesFollowTheCycle) {
  ModelConfig c = preset("tiny");
  for (int64_t L = 1; L <= 13; ++L) {
    c.layers = L;
    for (int64_t i = 0; i < L; ++i) {
      LayerSlot s = slot_of_layer(c, i);
      EXPECT_EQ(layer_of_slot(c, s), i);
      EXPECT_EQ(s.kind() == LayerKind::FullAttention, c.is_full_attention(i)) << "L=" << L << " i=" << i;
    }
  }
  c.layers = 7;  // 1 block of 4, then 3 remainder layers, all linear attention
  EXPECT_EQ(c.remainder(), 3);
  EXPECT_EQ(slot_of_layer(c, 6).group, StackGroup::Remainder);
  EXPECT_EQ(slot_of_layer(c, 6).block, 2);
}

TEST(StackedLayout, StackedShapesAndLayerViews) {
  ModelConfig c = preset("tiny");
  c.layers = 7;
  MemoryAccountant mem;
  ParamSet ps(c, DType::F32, mem, MemCategory::Parameters, false);
  const StackedParam* qkv = ps.find("local.linear_attn.in_proj_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->tensor.shape(), (Shape{1, 3, c.conv_dim(), c.hidden}));
  const StackedParam* gu = ps.find("global.mlp.experts.gate_up_proj");
  ASSERT_NE(gu, nullptr);
  EXPECT_EQ(gu->tensor.shape(), (Shape{1, c.experts, 2 * c.expert_inter, c.hidden}));
  const StackedParam* rem = ps.find("remainder.linear_attn.A_log");
  ASSERT_NE(rem, nullptr);
  EXPECT_EQ(rem->tensor.shape(), (Shape{3, c.v_heads}));
  // A layer's view points into its slice of the stack.
  LayerWeights w = ps.layer({StackGroup::Local, 0, 2});
  EXPECT_EQ(w[p::kQkv].data, static_cast<char*>(qkv->tensor.data()) + 2 * c.conv_dim() * c.hidden * 4);
  LayerWeights r = ps.layer({StackGroup::Remainder, 1, 0});
  EXPECT_EQ(r[p::kALog].data, static_cast<char*>(rem->tensor.data()) + 1 * c.v_heads * 4);
  // bf16 storage keeps A_log and dt_bias in fp32.
  ParamSet half(c, DType::BF16, mem, MemCategory::Parameters, false);
  EXPECT_EQ(half.find("local.linear_attn.A_log")->tensor.dtype(), DType::F32);
  EXPECT_EQ(half.find("local.linear_attn.in_proj_qkv.weight")->tensor.dtype(), DType::BF16);
}

}  // namespace hs::model
