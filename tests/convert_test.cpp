// Conversion between Hugging Face checkpoints and native stacked ones: lossless round trips, values on the right
// axes, logits preserved, and bad input refused without leaving anything behind.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <random>

#include "checkpoint/convert.h"
#include "checkpoint/hf_io.h"
#include "train/schedule.h"
#include "test_util.h"

namespace hs::checkpoint {
namespace {

namespace fs = std::filesystem;

model::ModelConfig config(model::Family f, int64_t L, bool mtp = false) {
  model::ModelConfig c = model::preset("tiny");
  c.family = f;
  c.layers = L;
  c.mtp_layers = mtp ? 1 : 0;
  return c;
}

// A synthetic Hugging Face checkpoint written directly from the HF names: random bytes, the dtypes real Qwen3.5
// files have (BF16, with A_log and linear_attn.norm in F32), optionally sharded, with extra mtp/visual tensors.
void write_hf(const fs::path& dir, const model::ModelConfig& c, ExpertLayout ex, uint64_t shard_bytes, uint32_t seed,
              bool extras) {
  HfLayout lay = hf_layout(c, ex);
  std::vector<TensorDecl> decls;
  for (const HfTensor& t : lay.hf) {
    bool f32 = t.name.find("A_log") != std::string::npos || t.name.find("linear_attn.norm") != std::string::npos;
    decls.push_back({t.name, f32 ? FileDType::F32 : FileDType::BF16, t.shape});
  }
  if (extras) {
    // A config without an MTP layer skips mtp.*; with one, the real mtp.* tensors are in the layout above.
    if (c.mtp_layers == 0) decls.push_back({"mtp.fc.weight", FileDType::BF16, {4, 4}});
    decls.push_back({"model.visual.patch_embed.weight", FileDType::BF16, {2, 3}});
  }
  sort_like_reference_writer(decls);
  std::mt19937 rng(seed);
  {
    ShardedWriter w(dir, decls, shard_bytes, {{"format", "pt"}});
    for (const TensorDecl& d : decls) {
      std::vector<std::byte> b(d.nbytes());
      for (auto& x : b) x = std::byte(rng() & 0xff);
      w.write(d.name, b);
    }
    w.commit();
  }
  std::ofstream(dir / "config.json") << model::config_to_hf_json(c).dump(2);
}

// skip_extras: the tensors conversion skips (model.visual.*, and mtp.* when the model has no MTP layer) are not
// compared; with `mtp` the mtp.* tensors are compared like the rest.
void expect_same_tensors(const fs::path& a, const fs::path& b, bool skip_extras, bool mtp = false) {
  auto skipped = [&](const std::string& n) { return is_skipped_hf_tensor(n) && !(mtp && n.rfind("mtp.", 0) == 0); };
  CheckpointReader ra(a), rb(b);
  size_t n = 0;
  for (const std::string& name : ra.tensor_names()) {
    if (skip_extras && skipped(name)) continue;
    ASSERT_TRUE(rb.contains(name)) << name;
    const TensorInfo &x = ra.info(name), &y = rb.info(name);
    EXPECT_EQ(x.dtype, y.dtype) << name;
    EXPECT_EQ(x.shape, y.shape) << name;
    auto bx = ra.bytes(name), by = rb.bytes(name);
    ASSERT_EQ(bx.size(), by.size()) << name;
    EXPECT_EQ(0, std::memcmp(bx.data(), by.data(), bx.size())) << name;
    ++n;
  }
  size_t m = 0;
  for (const std::string& name : rb.tensor_names()) m += !(skip_extras && skipped(name));
  EXPECT_EQ(n, m);
}

class RoundTrip : public ::testing::TestWithParam<std::tuple<model::Family, int, ExpertLayout, bool, bool>> {};

// HF -> native (scanned and unscanned) -> HF reproduces every tensor byte for byte: names, dtypes, shapes, bytes.
// With an MTP layer (the last tuple member) its mtp.* tensors are carried and compared too.
TEST_P(RoundTrip, HuggingFaceToNativeToHuggingFaceIsByteIdentical) {
  auto [fam, L, ex, sharded, mtp] = GetParam();
  test::TempDir t;
  model::ModelConfig c = config(fam, L, mtp);
  write_hf(t / "hf", c, ex, sharded ? 40000 : 1ull << 40, 7 + uint32_t(L), true);
  for (Layout layout : {Layout::Scanned, Layout::Unscanned}) {
    const std::string tag = layout == Layout::Scanned ? "scanned" : "unscanned";
    ConvertOptions to_native;
    to_native.layout = layout;
    ConvertReport r = convert_checkpoint(t / "hf", t / ("native_" + tag), to_native);
    EXPECT_EQ(r.skipped, mtp ? 1u : 2u);
    CheckpointDir n = open_checkpoint_dir(t / ("native_" + tag));
    EXPECT_EQ(n.format, Format::Native);
    EXPECT_EQ(n.layout, layout);
    EXPECT_EQ(n.config.mtp_layers, mtp ? 1 : 0);
    if (mtp) {  // the native checkpoint holds the MTP tensors under their own names
      CheckpointReader nr(t / ("native_" + tag));
      EXPECT_TRUE(nr.contains(layout == Layout::Scanned ? "mtp.layers.self_attn.q_proj.weight"
                                                         : "mtp.layers.0.self_attn.q_proj.weight"));
      EXPECT_TRUE(nr.contains("mtp.fc.weight"));
    }
    ConvertOptions to_hf;
    to_hf.to = Format::HuggingFace;
    to_hf.max_shard_bytes = sharded ? 40000 : 1ull << 40;
    convert_checkpoint(t / ("native_" + tag), t / ("back_" + tag), to_hf);
    expect_same_tensors(t / "hf", t / ("back_" + tag), /*skip_extras=*/true, mtp);
    EXPECT_EQ(CheckpointReader(t / ("back_" + tag)).sharded(), sharded);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, RoundTrip,
    ::testing::Values(std::make_tuple(model::Family::Qwen3Next, 4, ExpertLayout::PerExpert, false, false),
                      std::make_tuple(model::Family::Qwen3Next, 6, ExpertLayout::PerExpert, true, false),
                      std::make_tuple(model::Family::Qwen3Next, 7, ExpertLayout::Fused, false, false),
                      std::make_tuple(model::Family::Qwen3_5, 4, ExpertLayout::Fused, true, false),
                      std::make_tuple(model::Family::Qwen3_5, 6, ExpertLayout::Fused, false, false),
                      std::make_tuple(model::Family::Qwen3_5, 7, ExpertLayout::PerExpert, false, false),
                      std::make_tuple(model::Family::Qwen3Next, 7, ExpertLayout::PerExpert, true, true),
                      std::make_tuple(model::Family::Qwen3_5, 6, ExpertLayout::Fused, false, true)),
    [](const auto& param_info) {
      const auto& p = param_info.param;
      return std::string(std::get<0>(p) == model::Family::Qwen3Next ? "qwen3next" : "qwen35") + "_L" +
             std::to_string(std::get<1>(p)) + (std::get<2>(p) == ExpertLayout::Fused ? "_fused" : "_per_expert") +
             (std::get<3>(p) ? "_sharded" : "") + (std::get<4>(p) ? "_mtp" : "");
    });

// A config.json that announces an MTP layer over files without any mtp.* tensor (transformers' save_pretrained
// drops them): read as the decoder alone, converted, and its config says so from then on.
TEST(Convert, ConfigWithMtpOverFilesWithoutItReadsAsNoMtp) {
  test::TempDir t;
  const model::ModelConfig c = config(model::Family::Qwen3_5, 4);
  write_hf(t / "hf", c, ExpertLayout::Fused, 1ull << 40, 3, /*extras=*/false);
  model::ModelConfig announced = c;
  announced.mtp_layers = 1;
  std::ofstream(t / "hf" / "config.json") << model::config_to_hf_json(announced).dump(2);
  CheckpointDir d = open_checkpoint_dir(t / "hf");
  EXPECT_EQ(d.config.mtp_layers, 0);
  convert_checkpoint(t / "hf", t / "native", {});
  EXPECT_EQ(open_checkpoint_dir(t / "native").config.mtp_layers, 0);
  ConvertOptions to_hf;
  to_hf.to = Format::HuggingFace;
  convert_checkpoint(t / "native", t / "back", to_hf);
  expect_same_tensors(t / "hf", t / "back", /*skip_extras=*/false);
}

// The transformers-written fixtures: HF -> native -> HF gives back every decoder tensor byte for byte (Qwen3-Next's
// whole file, which has no skipped tensors, is identical too), and the native copy gives the same logits.
TEST(Convert, TransformersCheckpointsRoundTripAndKeepTheirLogits) {
  for (const char* name : {"qwen3_next_L7", "qwen3_5_L5"}) {
    test::TempDir t;
    const fs::path src = fs::path(hs::test::source_dir()) / "tests/fixtures/parity" / name;
    convert_checkpoint(src, t / "native", {});
    ConvertOptions to_hf;
    to_hf.to = Format::HuggingFace;
    convert_checkpoint(t / "native", t / "hf", to_hf);
    expect_same_tensors(src, t / "hf", true);
    if (std::string(name) == "qwen3_next_L7") {
      std::ifstream a(src / "model.safetensors", std::ios::binary), b(t / "hf/model.safetensors", std::ios::binary);
      EXPECT_TRUE(std::equal(std::istreambuf_iterator<char>(a), {}, std::istreambuf_iterator<char>(b), {}));
    }
    CheckpointDir hf = open_checkpoint_dir(src), nat = open_checkpoint_dir(t / "native");
    MemoryAccountant mem;
    model::ParamSet p1(hf.config, DType::F32, mem, MemCategory::Parameters, false);
    model::ParamSet p2(nat.config, DType::F32, mem, MemCategory::Parameters, false);
    load_parameters(hf, p1);
    load_parameters(nat, p2);
    std::vector<int32_t> ids(40);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 37) % 256);
    std::vector<float> l1(40 * 256), l2(40 * 256);
    train::forward_only(p1, {ids.data(), ids.data(), 1, 40}, DType::F32, mem, l1.data());
    train::forward_only(p2, {ids.data(), ids.data(), 1, 40}, DType::F32, mem, l2.data());
    EXPECT_EQ(l1, l2) << name;
  }
}

// Distinct known values per (layer, expert, half, row) in a per-expert HF checkpoint land at
// stacked [block][local][expert][half * I + row] of the native gate_up tensor.
TEST(Convert, PerExpertGateUpValuesLandOnTheRightAxes) {
  test::TempDir t;
  model::ModelConfig c = config(model::Family::Qwen3Next, 8);
  HfLayout lay = hf_layout(c, ExpertLayout::PerExpert);
  std::vector<TensorDecl> decls;
  for (const HfTensor& h : lay.hf) decls.push_back({h.name, FileDType::F32, h.shape});
  const int64_t I = c.expert_inter, H = c.hidden;
  auto code = [](int64_t layer, int64_t e, int64_t half, int64_t row) { return float(layer * 1000 + e * 100 + half * 50 + row); };
  {
    ShardedWriter w(t / "hf", decls, 1ull << 40);
    for (const TensorDecl& d : decls) {
      std::vector<float> v(size_t(numel(d.shape)), -1.f);
      int layer, e;
      char kind[16];
      if (std::sscanf(d.name.c_str(), "model.layers.%d.mlp.experts.%d.%15[a-z]_proj.weight", &layer, &e, kind) == 3 &&
          (std::string(kind) == "gate" || std::string(kind) == "up"))
        for (int64_t r = 0; r < I; ++r)
          for (int64_t h = 0; h < H; ++h) v[size_t(r * H + h)] = code(layer, e, std::string(kind) == "up", r);
      w.write(d.name, std::as_bytes(std::span(v)));
    }
    w.commit();
  }
  std::ofstream(t / "hf/config.json") << model::config_to_hf_json(c).dump();
  convert_checkpoint(t / "hf", t / "native", {});
  CheckpointReader r(t / "native");
  for (const char* g : {"local", "global"}) {
    const std::string n = std::string(g) + ".mlp.experts.gate_up_proj";
    const TensorInfo& info = r.info(n);
    std::vector<float> v(info.numel());
    r.read_f32(n, v);
    const bool global = std::string(g) == "global";
    const int64_t nl = global ? 1 : 3;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t l = 0; l < nl; ++l)
        for (int64_t e = 0; e < c.experts; ++e)
          for (int64_t half = 0; half < 2; ++half)
            for (int64_t row = 0; row < I; row += 7) {
              const int64_t layer = b * 4 + (global ? 3 : l);
              const int64_t idx = ((((b * nl + l) * c.experts + e) * 2 * I) + half * I + row) * H + 5;
              ASSERT_EQ(v[size_t(idx)], code(layer, e, half, row)) << n << " b" << b << " l" << l << " e" << e;
            }
  }
}

void expect_refused(const fs::path& from, const fs::path& to, const std::string& needle) {
  try {
    convert_checkpoint(from, to, {});
    ADD_FAILURE() << "conversion of " << from << " should fail with '" << needle << "'";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(to)) << "nothing may be left at the destination";
  for (const auto& entry : fs::directory_iterator(to.parent_path()))
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << entry.path();
}

TEST(Convert, BadInputIsRefusedAndLeavesNothing) {
  test::TempDir t;
  model::ModelConfig c = config(model::Family::Qwen3_5, 5);
  write_hf(t / "good", c, ExpertLayout::Fused, 1ull << 40, 3, false);
  auto copy = [&](const std::string& name) {
    fs::copy(t / "good", t / name, fs::copy_options::recursive);
    return t / name;
  };
  {  // truncated file
    fs::path p = copy("truncated");
    fs::resize_file(p / "model.safetensors", fs::file_size(p / "model.safetensors") - 100);
    expect_refused(p, t / "out1", "model.safetensors");
  }
  {  // corrupt header
    fs::path p = copy("corrupt");
    std::fstream f(p / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(12);
    f.write("#", 1);
    f.close();
    expect_refused(p, t / "out2", "model.safetensors");
  }
  {  // wrong family: the config says Qwen3-Next, the tensors are Qwen3.5's
    fs::path p = copy("family");
    model::ModelConfig next = c;
    next.family = model::Family::Qwen3Next;
    std::ofstream(p / "config.json") << model::config_to_hf_json(next).dump();
    expect_refused(p, t / "out3", "does not belong to this config");
  }
  {  // shape mismatch: the config's expert width disagrees with the tensors
    fs::path p = copy("shape");
    model::ModelConfig wide = c;
    wide.expert_inter = 48;
    std::ofstream(p / "config.json") << model::config_to_hf_json(wide).dump();
    expect_refused(p, t / "out4", "shape");
  }
  {  // missing tensor: a config with one more layer than the file holds
    fs::path p = copy("missing");
    model::ModelConfig more = c;
    more.layers = 6;
    std::ofstream(p / "config.json") << model::config_to_hf_json(more).dump();
    expect_refused(p, t / "out5", "missing tensor");
  }
  {  // extra tensor: a config with one layer fewer than the file holds
    fs::path p = copy("extra");
    model::ModelConfig fewer = c;
    fewer.layers = 4;
    std::ofstream(p / "config.json") << model::config_to_hf_json(fewer).dump();
    expect_refused(p, t / "out6", "unexpected tensor");
  }
  {  // a non-empty destination is not overwritten unless asked
    fs::create_directories(t / "taken");
    std::ofstream(t / "taken/precious.txt") << "keep";
    EXPECT_THROW(convert_checkpoint(t / "good", t / "taken", {}), std::runtime_error);
    EXPECT_TRUE(fs::exists(t / "taken/precious.txt"));
  }
}

// A full disk mid-write (RLIMIT_FSIZE makes writes fail with EFBIG): a clear error naming the file, nothing left.
TEST(Convert, FullDiskLeavesNothing) {
  test::TempDir t;
  write_hf(t / "good", config(model::Family::Qwen3Next, 4), ExpertLayout::PerExpert, 1ull << 40, 5, false);
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit old;
  getrlimit(RLIMIT_FSIZE, &old);
  rlimit small = old;
  small.rlim_cur = 200000;
  setrlimit(RLIMIT_FSIZE, &small);
  std::string msg;
  try {
    convert_checkpoint(t / "good", t / "out", {});
  } catch (const std::exception& e) {
    msg = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, SIG_DFL);
  EXPECT_NE(msg.find("safetensors"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(t / "out"));
  for (const auto& entry : fs::directory_iterator(t.path()))
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos);
}

}  // namespace
}  // namespace hs::checkpoint
