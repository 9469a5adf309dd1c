// Weights for inference (infer/weights.h): a checkpoint in the asked dtype is used in place through the mapping (no
// byte of it in the accountant, the tensors' data pointers inside the files' map), native scanned stacks and Hugging
// Face per-layer tensors alike; only what must be converted or reordered is copied. All give the same generation.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>

#include "checkpoint/convert.h"
#include "infer/generate.h"
#include "infer/weights.h"
#include "test_util.h"

namespace hs::infer {
namespace {

const std::string kParity = hs::test::source_dir() + "/tests/fixtures/parity/";

// Bytes of the tensors the engine keeps in fp32 whatever the weight dtype (A_log, dt_bias).
size_t fp32_kept_bytes(const model::ParamSet& ps) {
  size_t n = 0;
  for (const auto& sp : ps.all())
    if (sp.spec.keep_fp32) n += static_cast<size_t>(numel(sp.full_shape)) * 4;
  return n;
}

TEST(InferenceWeights, NativeCheckpointsAreMappedInTheirStoredDtype) {
  test::TempDir dir;
  MemoryAccountant mem;
  const model::ModelConfig cfg = model::load_config(kParity + "qwen3_5_L7");
  model::ParamSet ps(cfg, DType::BF16, mem, MemCategory::Parameters, false);
  model::init_params(ps, 9);
  checkpoint::save_native(dir / "ck", {&ps, nullptr, nullptr, nlohmann::json{{"step", 0}}, {}});
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(dir / "ck");

  GenerateOptions opt;
  opt.max_new_tokens = 20;
  opt.compute = DType::BF16;
  const std::vector<std::vector<int32_t>> prompts = {{3, 1, 4, 1, 5, 9, 2, 6}};
  const auto want = generate(ps, prompts, opt, mem).tokens;

  MemoryAccountant fresh;
  auto mapped = load_weights(d, std::nullopt, fresh);
  ASSERT_TRUE(mapped->mapped) << (mapped->notes.empty() ? "" : mapped->notes[0]);
  EXPECT_EQ(fresh.live_total(), 0u);
  for (const auto& sp : mapped->params->all()) {
    EXPECT_EQ(sp.tensor.data(), mapped->reader->bytes(sp.name).data()) << sp.name;
    EXPECT_EQ(sp.dtype, ps.find(sp.name)->dtype) << sp.name;
  }
  EXPECT_EQ(generate(*mapped->params, prompts, opt, fresh).tokens, want);

  // Asked for fp32: converted into memory, with the reason.
  MemoryAccountant other;
  auto copied = load_weights(d, DType::F32, other);
  EXPECT_FALSE(copied->mapped);
  ASSERT_FALSE(copied->notes.empty());
  EXPECT_NE(copied->notes[0].find("stored as BF16"), std::string::npos) << copied->notes[0];
  EXPECT_EQ(other.live_total(), copied->copied_bytes);
  EXPECT_EQ(copied->mapped_bytes, fp32_kept_bytes(*copied->params));  // A_log, dt_bias: fp32 already
  EXPECT_EQ(copied->copied_bytes + copied->mapped_bytes, copied->params->nbytes());
  EXPECT_EQ(copied->params->global(model::g::kEmbed).dtype, DType::F32);
}

// Every byte range the checkpoint's files hold a tensor in.
std::vector<std::span<const std::byte>> file_tensors(const checkpoint::CheckpointReader& r) {
  std::vector<std::span<const std::byte>> v;
  for (const std::string& n : r.tensor_names()) v.push_back(r.bytes(n));
  return v;
}
bool inside(const std::vector<std::span<const std::byte>>& spans, const TensorView& t) {
  const auto* p = static_cast<const std::byte*>(t.data);
  for (const auto& s : spans)
    if (p >= s.data() && p + t.nbytes() <= s.data() + s.size()) return true;
  return false;
}

// A bf16 model of the family written as a native checkpoint and exported to Hugging Face, in one file and in shards.
struct HfExport {
  test::TempDir dir;
  MemoryAccountant mem;
  model::ModelConfig cfg;
  std::unique_ptr<model::ParamSet> ps;
  std::vector<std::vector<int32_t>> want;  // tokens generated from the in-memory set
  GenerateOptions opt;
  const std::vector<std::vector<int32_t>> prompts = {{3, 1, 4, 1, 5, 9, 2, 6}, {2, 7}};

  explicit HfExport(const std::string& fixture) : cfg(model::load_config(kParity + fixture)) {
    ps = std::make_unique<model::ParamSet>(cfg, DType::BF16, mem, MemCategory::Parameters, false);
    model::init_params(*ps, 5);
    checkpoint::save_native(dir / "native", {ps.get(), nullptr, nullptr, nlohmann::json{{"step", 0}}, {}});
    checkpoint::ConvertOptions one;
    one.to = checkpoint::Format::HuggingFace;
    checkpoint::convert_checkpoint(dir / "native", dir / "hf", one);
    checkpoint::ConvertOptions shards = one;
    shards.max_shard_bytes = 40'000;  // several shards: tensors of one layer in different files
    checkpoint::convert_checkpoint(dir / "native", dir / "hf-sharded", shards);
    opt.max_new_tokens = 16;
    opt.compute = DType::BF16;
    want = generate(*ps, prompts, opt, mem).tokens;
  }
  // Bytes of the stacked tensors whose names end in one of `suffixes`.
  size_t bytes_of(const std::vector<std::string>& suffixes) const {
    size_t n = 0;
    for (const auto& sp : ps->all())
      for (const std::string& s : suffixes)
        if (sp.name.size() >= s.size() && sp.name.compare(sp.name.size() - s.size(), s.size(), s) == 0)
          n += sp.tensor.nbytes();
    return n;
  }
};

// Qwen3.5 stores every tensor the way a layer reads it: a bf16 Hugging Face checkpoint is used in place, every layer
// view pointing into the files' map, nothing in the accountant, and it generates the same tokens.
TEST(InferenceWeights, HuggingFaceBf16CheckpointsAreMappedInPlace) {
  HfExport x("qwen3_5_L7");  // one block and three remainder layers
  for (const char* sub : {"hf", "hf-sharded"}) {
    SCOPED_TRACE(sub);
    const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(x.dir / sub);
    ASSERT_EQ(d.format, checkpoint::Format::HuggingFace);
    MemoryAccountant fresh;
    auto w = load_weights(d, std::nullopt, fresh);
    ASSERT_TRUE(w->mapped) << (w->notes.empty() ? "" : w->notes.back());
    EXPECT_EQ(w->copied_bytes, 0u);
    EXPECT_EQ(fresh.live_total(), 0u);
    EXPECT_EQ(w->mapped_bytes, x.ps->nbytes());
    EXPECT_EQ(w->params->nbytes(), x.ps->nbytes());
    if (std::string(sub) == "hf-sharded") {
      EXPECT_GT(w->reader->files().size(), 2u);
    }
    const auto spans = file_tensors(*w->reader);
    size_t views = 0;
    for (int64_t l = 0; l < x.cfg.layers; ++l) {
      const model::LayerSlot s = model::slot_of_layer(x.cfg, l);
      const model::LayerWeights lw = w->params->layer(s), ref = x.ps->layer(s);
      ASSERT_EQ(lw.t.size(), ref.t.size());
      for (size_t i = 0; i < lw.t.size(); ++i, ++views) {
        EXPECT_TRUE(inside(spans, lw.t[i])) << "layer " << l << " tensor " << i;
        ASSERT_EQ(lw.t[i].shape, ref.t[i].shape);
        ASSERT_EQ(lw.t[i].dtype, ref.t[i].dtype);
        EXPECT_EQ(std::memcmp(lw.t[i].data, ref.t[i].data, ref.t[i].nbytes()), 0) << "layer " << l << " tensor " << i;
      }
    }
    EXPECT_GT(views, 0u);
    for (auto g : {model::g::kEmbed, model::g::kFinalNorm, model::g::kLmHead})
      EXPECT_TRUE(inside(spans, w->params->global(g)));
    EXPECT_EQ(generate(*w->params, x.prompts, x.opt, fresh).tokens, x.want);

    // --weight-dtype fp32 converts everything at load, into the accountant (but A_log and dt_bias, fp32 already).
    MemoryAccountant other;
    auto f = load_weights(d, DType::F32, other);
    EXPECT_FALSE(f->mapped);
    EXPECT_EQ(f->mapped_bytes, fp32_kept_bytes(*f->params));
    EXPECT_EQ(other.live_total(), f->copied_bytes);
    EXPECT_EQ(f->copied_bytes + f->mapped_bytes, f->params->nbytes());
    EXPECT_EQ(f->params->global(model::g::kLmHead).dtype, DType::F32);
  }
}

// Qwen3-Next interleaves q, k, v, z per key head in in_proj_qkvz (and b, a in in_proj_ba) and stores each expert's
// projections apart: exactly those stacks are assembled in memory, with a note; the rest is used in place.
TEST(InferenceWeights, HuggingFaceQwen3NextCopiesOnlyTheTensorsItMustReorder) {
  HfExport x("qwen3_next_L5");  // one block and a remainder layer
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(x.dir / "hf-sharded");
  ASSERT_EQ(d.hf.experts, checkpoint::ExpertLayout::PerExpert);
  MemoryAccountant fresh;
  auto w = load_weights(d, std::nullopt, fresh);
  EXPECT_FALSE(w->mapped);
  const size_t reordered = x.bytes_of({"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                       "in_proj_a.weight", "experts.gate_up_proj", "experts.down_proj"});
  EXPECT_EQ(w->copied_bytes, reordered);
  EXPECT_EQ(fresh.live_total(), reordered);
  EXPECT_EQ(w->mapped_bytes + w->copied_bytes, x.ps->nbytes());
  std::string notes;
  for (const auto& n : w->notes) notes += n + "\n";
  EXPECT_NE(notes.find("in_proj_qkvz"), std::string::npos) << notes;
  EXPECT_NE(notes.find("experts.0.gate_proj"), std::string::npos) << notes;
  EXPECT_EQ(notes.find("o_proj"), std::string::npos) << notes;
  const auto spans = file_tensors(*w->reader);
  const model::LayerWeights full = w->params->layer(model::slot_of_layer(x.cfg, 3));  // the attention layer
  EXPECT_TRUE(inside(spans, full[model::p::kQ]));
  EXPECT_TRUE(inside(spans, full[size_t(model::p::kFullFfn) + model::p::kSharedUp]));
  EXPECT_FALSE(inside(spans, full[size_t(model::p::kFullFfn) + model::p::kGateUp]));
  EXPECT_EQ(generate(*w->params, x.prompts, x.opt, fresh).tokens, x.want);
}

// transformers' own fp32 checkpoint: used in its stored dtype (in place where the layout allows), or converted.
TEST(InferenceWeights, HuggingFaceCheckpointsKeepTheirStoredDtype) {
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(kParity + "qwen3_next_L5");
  EXPECT_EQ(stored_weight_dtype(d), DType::F32);
  MemoryAccountant mem;
  auto w = load_weights(d, std::nullopt, mem);
  EXPECT_EQ(w->params->global(model::g::kLmHead).dtype, DType::F32);
  EXPECT_GT(w->mapped_bytes, 0u);
  EXPECT_EQ(mem.live_total(), w->copied_bytes);
  EXPECT_EQ(w->mapped_bytes + w->copied_bytes, w->params->nbytes());
  MemoryAccountant other;
  auto b = load_weights(d, DType::BF16, other);
  EXPECT_EQ(b->params->global(model::g::kLmHead).dtype, DType::BF16);
  EXPECT_EQ(b->mapped_bytes, fp32_kept_bytes(*b->params));
  EXPECT_EQ(other.live_total(), b->copied_bytes);
}

// --weights-memory copy: every tensor but the embedding read once into the accountant (Parameters) in the dtype asked
// for, bit for bit what the files hold, and the same generation; native, Hugging Face single file and
// sharded, and Qwen3-Next (whose reordered stacks are assembled as in map mode).
TEST(InferenceWeights, CopyModeHoldsEveryTensorInMemory) {
  for (const char* fixture : {"qwen3_5_L7", "qwen3_next_L5"}) {
    HfExport x(fixture);
    for (const char* sub : {"native", "hf", "hf-sharded"}) {
      SCOPED_TRACE(std::string(fixture) + " " + sub);
      const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(x.dir / sub);
      MemoryAccountant mem;
      auto w = load_weights(d, std::nullopt, mem, WeightsMemory::Copy);
      EXPECT_EQ(w->memory, WeightsMemory::Copy);
      EXPECT_FALSE(w->mapped);
      // The embedding table stays in place (a row a step); every other byte is in the accountant.
      const size_t embed = x.ps->global(model::g::kEmbed).nbytes();
      EXPECT_EQ(w->mapped_bytes, embed);
      EXPECT_EQ(w->copied_bytes, x.ps->nbytes() - embed);
      EXPECT_EQ(mem.live_total(), w->copied_bytes);
      ASSERT_NE(w->reader, nullptr);
      EXPECT_TRUE(inside(file_tensors(*w->reader), w->params->global(model::g::kEmbed)));
      EXPECT_FALSE(inside(file_tensors(*w->reader), w->params->global(model::g::kLmHead)));
      for (const auto& sp : x.ps->all()) {
        const model::StackedParam* c = w->params->find(sp.name);
        ASSERT_NE(c, nullptr) << sp.name;
        ASSERT_EQ(c->dtype, sp.dtype) << sp.name;
        ASSERT_EQ(c->tensor.nbytes(), sp.tensor.nbytes()) << sp.name;
        EXPECT_EQ(std::memcmp(c->tensor.data(), sp.tensor.data(), sp.tensor.nbytes()), 0) << sp.name;
      }
      EXPECT_EQ(generate(*w->params, x.prompts, x.opt, mem).tokens, x.want);
      // Converted at load (--weight-dtype fp32): the same tensors as map mode converts, and the rest copied too.
      MemoryAccountant other;
      auto f = load_weights(d, DType::F32, other, WeightsMemory::Copy);
      EXPECT_EQ(f->mapped_bytes, 0u);  // the bf16 embedding converted too
      EXPECT_EQ(other.live_total(), f->params->nbytes());
    }
  }
}

// A config.json that does not match the weights (experts wider than stored): a clear error naming the shapes in both
// modes, and nothing read past a stored tensor first (copy mode once copied the layout's bytes before the check).
TEST(InferenceWeights, AConfigWiderThanTheStoredTensorsIsAClearErrorInEveryMode) {
  HfExport x("qwen3_5_L7");
  const std::filesystem::path bad = x.dir / "hf-bad";
  std::filesystem::copy(x.dir / "hf", bad);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(bad / "config.json"));
  nlohmann::json& text = cfg.contains("text_config") ? cfg["text_config"] : cfg;
  text["moe_intermediate_size"] = text["moe_intermediate_size"].get<int>() * 2;
  std::ofstream(bad / "config.json") << cfg.dump(2);
  for (WeightsMemory how : {WeightsMemory::Map, WeightsMemory::Copy}) {
    SCOPED_TRACE(weights_memory_name(how));
    const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(bad);
    MemoryAccountant mem;
    const std::string e = test::error_of([&] { load_weights(d, std::nullopt, mem, how); });
    EXPECT_NE(e.find("shape"), std::string::npos) << e;
    EXPECT_NE(e.find("expected"), std::string::npos) << e;
  }
}

TEST(InferenceWeights, WeightsMemoryChoices) {
  EXPECT_EQ(parse_weights_memory("map"), WeightsMemory::Map);
  EXPECT_EQ(parse_weights_memory("copy"), WeightsMemory::Copy);
  EXPECT_EQ(parse_weights_memory("auto"), WeightsMemory::Auto);
  EXPECT_THROW(parse_weights_memory("huge"), std::invalid_argument);
  const uint64_t GiB = uint64_t{1} << 30;
  EXPECT_TRUE(auto_copies(3 * GiB, 8 * GiB));    // 3 + 1 <= 8 / 2
  EXPECT_FALSE(auto_copies(3 * GiB + 1, 8 * GiB));
  EXPECT_FALSE(auto_copies(70 * GiB, 120 * GiB));  // a 35B bf16 model on 128 GiB: map
  EXPECT_FALSE(auto_copies(1, 0));                 // unknown: map
  EXPECT_GT(available_memory_bytes(), 0u);         // Linux: /proc/meminfo
  // Auto resolves to one of the two.
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(kParity + "qwen3_5_L7");
  MemoryAccountant mem;
  auto w = load_weights(d, std::nullopt, mem, WeightsMemory::Auto);
  EXPECT_NE(w->memory, WeightsMemory::Auto);
  if (available_memory_bytes() > 4 * GiB) {
    EXPECT_EQ(w->memory, WeightsMemory::Copy);  // a fixture of kilobytes
  }
}

}  // namespace
}  // namespace hs::infer
