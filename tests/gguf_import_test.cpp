// GGUF models written by llama.cpp's own convert_hf_to_gguf.py (tests/fixtures/gguf, made by
// scripts/make_gguf_fixtures.py from the transformers parity fixtures) imported into hybridscan's model: the same
// parameters as the Hugging Face checkpoint they were converted from, the same logits as transformers, Q8_0 within
// its rounding of the fp32 file, the tokenizer and chat template from the metadata, and bad files refused naming the
// tensor. Dropping any one of the undone transforms (the norms' +1, -exp(A_log), the ssm_ba split, Qwen3.5's V-head
// order) moves some tensor by O(1) and fails ImportEqualsTheHuggingFaceCheckpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/convert.h"
#include "checkpoint/hf_io.h"
#include "gguf/export.h"
#include "gguf/import.h"
#include "kernels/quant.h"
#include "model/params.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"
#include "train/schedule.h"

namespace hs::gguf {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return test::source_dir() + "/tests/fixtures/gguf/" + name + ".gguf"; }
// The Hugging Face checkpoint a fixture was converted from: the parity fixtures (MoE), or the dense Qwen3.5 that
// scripts/make_gguf_fixtures.py --dense writes beside the GGUF fixtures.
std::string parity(const std::string& name) {
  const std::string own = test::source_dir() + "/tests/fixtures/gguf/" + name;
  return fs::is_directory(own) ? own : test::source_dir() + "/tests/fixtures/parity/" + name;
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag)
      : path(fs::temp_directory_path() / ("gguf_import_test_" + tag + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::unique_ptr<model::ParamSet> load_dir(const fs::path& dir, MemoryAccountant& mem) {
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(dir);
  auto ps = std::make_unique<model::ParamSet>(d.config, DType::F32, mem, MemCategory::Parameters, false);
  checkpoint::load_parameters(d, *ps);
  return ps;
}

bool is_shifted_norm(const std::string& n) {
  return n.find("layernorm") != std::string::npos || n.find("q_norm") != std::string::npos ||
         n.find("k_norm") != std::string::npos || n == "norm.weight" ||
         (n.rfind("mtp.", 0) == 0 && n.find("norm") != std::string::npos);  // the MTP layer's (nextn.*norm)
}

class GgufImport : public ::testing::TestWithParam<std::string> {};

// Tolerances: every tensor the converter only renames, splits or reorders is bit-identical. A norm weight w is stored
// as fl(w + 1) in fp32 and read back as fl(w + 1) - 1 (exact by Sterbenz for w + 1 in [0.5, 2]), so it is off by the
// rounding of w + 1: at most half an ulp of a number below 2, 2^-23 / 2 * 2 = 1.2e-7. A_log is stored as
// fl(-exp(A_log)) and read as log(-x): exp's and log's roundings (about an ulp each) give 2 * 2^-23 relative to
// values below 4 in magnitude: 1e-6 allows for both.
void expect_import_equals_the_checkpoint(const std::string& name) {
  TempDir tmp(name);
  import_gguf(fixture(name + ".f32"), tmp.path);
  MemoryAccountant mem;
  const auto ours = load_dir(tmp.path, mem);
  const auto ref = load_dir(parity(name), mem);
  ASSERT_EQ(ours->all().size(), ref->all().size());
  for (size_t k = 0; k < ref->all().size(); ++k) {
    const auto& a = ours->all()[k];
    const auto& b = ref->all()[k];
    ASSERT_EQ(a.name, b.name);
    const float* x = a.tensor.view().as<float>();
    const float* y = b.tensor.view().as<float>();
    const int64_t n = a.tensor.numel();
    ASSERT_EQ(n, b.tensor.numel()) << a.name;
    const double tol = is_shifted_norm(a.name) ? 1.2e-7 : a.name.find("A_log") != std::string::npos ? 1e-6 : 0.0;
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(double(x[i]) - y[i]));
    EXPECT_LE(worst, tol) << a.name;
  }
}
TEST_P(GgufImport, ImportEqualsTheHuggingFaceCheckpoint) { expect_import_equals_the_checkpoint(GetParam()); }

// The multi-token-prediction layer (tests/fixtures/gguf/qwen3_5_moe_mtp_L5: a Qwen3.5 MoE whose mtp.* tensors
// llama.cpp's converter kept as block 5 and its nextn.* tensors) comes back with the rest: every mtp.* tensor at the
// same tolerances (its three norms are +1 like the others), and the config keeps the layer.
TEST(GgufMtp, ImportKeepsTheMtpLayer) {
  expect_import_equals_the_checkpoint("qwen3_5_moe_mtp_L5");
  const GgufReader r(fixture("qwen3_5_moe_mtp_L5.f32"));
  EXPECT_EQ(config_from_gguf(r, /*with_mtp=*/true).mtp_layers, 1);
  EXPECT_EQ(config_from_gguf(r, /*with_mtp=*/true).layers, 5);
  EXPECT_EQ(config_from_gguf(r).mtp_layers, 0);  // decoding from the blocks leaves it out
}

// The imported model's logits against transformers' on the parity fixture's inputs, at the parity test's tolerance
// (tests/parity_test.cpp: 5e-5 relative RMS, fp32 against fp32).
TEST_P(GgufImport, LogitsEqualTransformers) {
  TempDir tmp(GetParam());
  import_gguf(fixture(GetParam() + ".f32"), tmp.path);
  MemoryAccountant mem;
  const auto ps = load_dir(tmp.path, mem);
  const checkpoint::CheckpointReader debug(parity(GetParam()) + "/debug.safetensors");
  const auto& info = debug.info("input_ids");
  const int64_t B = info.shape[0], T = info.shape[1];
  std::vector<int32_t> inputs(size_t(B * T)), targets(size_t(B * T), -1);
  std::memcpy(inputs.data(), debug.bytes("input_ids").data(), inputs.size() * 4);
  std::vector<float> logits(size_t(B * T * ps->config().vocab)), ref(logits.size());
  train::forward_only(*ps, train::Batch{inputs.data(), targets.data(), B, T}, DType::F32, mem, logits.data());
  debug.read_f32("logits", ref);
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (double(logits[i]) - ref[i]) * (double(logits[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  EXPECT_LT(std::sqrt(num / den), 5e-5);
}

INSTANTIATE_TEST_SUITE_P(Families, GgufImport, ::testing::Values("qwen3_next_L5", "qwen3_5_L5", "qwen3_5_dense_L5"));

// The converter's --outtype bf16 (matrices in BF16, rounded to nearest even by gguf-py) imports to exactly the
// bf16 rounding of the checkpoint's matrices; the vectors stay F32 and as exact as in the f32 file.
TEST(GgufImportQuantized, Bf16IsTheRoundingOfTheCheckpoint) {
  TempDir tmp("bf16");
  import_gguf(fixture("qwen3_5_L5.bf16"), tmp.path);
  MemoryAccountant mem;
  const auto ours = load_dir(tmp.path, mem);
  const auto ref = load_dir(parity("qwen3_5_L5"), mem);
  int rounded = 0;
  for (size_t k = 0; k < ref->all().size(); ++k) {
    const float* x = ours->all()[k].tensor.view().as<float>();
    const float* y = ref->all()[k].tensor.view().as<float>();
    const std::string& n = ref->all()[k].name;
    const bool matrix = ref->all()[k].spec.shape.size() >= 2 && n.find("conv1d") == std::string::npos &&
                        n.find("mlp.gate.weight") == std::string::npos;
    bool differs = false;
    for (int64_t i = 0; i < ref->all()[k].tensor.numel(); ++i) {
      if (matrix) {
        ASSERT_EQ(x[i], static_cast<float>(bf16(y[i]))) << n << " element " << i;
        differs = differs || x[i] != y[i];
      } else {
        ASSERT_NEAR(x[i], y[i], 1e-6) << n << " element " << i;
      }
    }
    rounded += differs;
  }
  EXPECT_GE(rounded, 10);
}

// The converter's --outtype q8_0 file against its f32 file: each value within what Q8_0 rounding allows. ggml rounds
// x / d with d = amax / 127 of its block of 32 and stores d in fp16: |x - fp16(d) q| <= d / 2 + 127 d 2^-11 < 0.57 d.
TEST(GgufImportQuantized, Q8_0WithinItsRoundingOfTheF32File) {
  TempDir a("q8"), b("f32");
  import_gguf(fixture("qwen3_next_L5.q8_0"), a.path);
  import_gguf(fixture("qwen3_next_L5.f32"), b.path);
  MemoryAccountant mem;
  const auto q = load_dir(a.path, mem);
  const auto f = load_dir(b.path, mem);
  int quantized = 0;
  for (size_t k = 0; k < f->all().size(); ++k) {
    const float* x = q->all()[k].tensor.view().as<float>();
    const float* y = f->all()[k].tensor.view().as<float>();
    const int64_t n = f->all()[k].tensor.numel();
    bool differs = false;
    for (int64_t blk = 0; blk * 32 < n; ++blk) {
      float amax = 0;
      for (int64_t i = blk * 32; i < std::min(n, blk * 32 + 32); ++i) amax = std::max(amax, std::abs(y[i]));
      for (int64_t i = blk * 32; i < std::min(n, blk * 32 + 32); ++i) {
        differs = differs || x[i] != y[i];
        ASSERT_LE(std::abs(double(x[i]) - y[i]), 0.57 * amax / 127 + 1e-7) << f->all()[k].name << " element " << i;
      }
    }
    quantized += differs;
  }
  EXPECT_GE(quantized, 20);  // the matrices were Q8_0 in the file (a test that compared f32 with itself would stop here)
}

TEST(GgufImportTokenizer, TokenizerAndChatTemplateFromTheMetadata) {
  TempDir tmp("tok");
  import_gguf(fixture("qwen3_5_L5.f32"), tmp.path);
  const tokenizer::Tokenizer t = tokenizer::Tokenizer::load((tmp.path / "tokenizer.json").string());
  EXPECT_EQ(t.encode("hello"), (std::vector<tokenizer::TokenId>{104, 101, 108, 108, 111}));
  EXPECT_EQ(t.vocab_size(), 256);
  std::ifstream in(tmp.path / "tokenizer_config.json");
  const nlohmann::json tc = nlohmann::json::parse(in);
  EXPECT_EQ(tc.at("chat_template").get<std::string>().rfind("{% for m in messages %}<|im_start|>", 0), 0u);
}

// The command line: `generate --checkpoint FILE.gguf` gives the tokens it gives from the Hugging Face checkpoint.
TEST(GgufImportCli, GenerateFromGgufEqualsTheHuggingFaceCheckpoint) {
  const std::string args = " --prompt-ids 104,101,108,108,111 --max-new-tokens 12 --temperature 0 --json --threads 1";
  for (const std::string name : {"qwen3_next_L5", "qwen3_5_L5"}) {
    const auto g = test::run_command(test::binary() + " generate --checkpoint " + fixture(name + ".f32") + args);
    const auto h = test::run_command(test::binary() + " generate --checkpoint " + parity(name) + args);
    ASSERT_EQ(g.rc, 0) << g.out;
    ASSERT_EQ(h.rc, 0) << h.out;
    auto tokens = [](const std::string& out) { return nlohmann::json::parse(out.substr(out.find('{'))).at("tokens"); };
    EXPECT_EQ(tokens(g.out), tokens(h.out)) << name;
  }
}

// generate decodes a Q8_0 file from its blocks by default (as --gguf-blocks does, bit for bit, and without writing its
// tensors anywhere), dequantizes it with --gguf-dequantize or when an option needs that (said on stderr), and refuses
// what cannot be. Its tokens are not compared with the dequantized run's: with Q8 activations this random-weight
// fixture's greedy tokens differ from the first one (QuantDecode.* proves the products with exact activations equal
// the dequantized path's to ~1e-6 and reports the activation rounding's effect).
TEST(GgufImportCli, GenerateFromTheQuantizedBlocks) {
  const std::string args = " --prompt-ids 104,101,108,108,111 --max-new-tokens 8 --temperature 0 --json --threads 1";
  const std::string f = fixture("qwen3_next_L5.q8_0");
  const auto blocks = test::run_command(test::binary() + " generate --gguf-blocks --checkpoint " + f + args);
  const auto by_default = test::run_command(test::binary() + " generate --checkpoint " + f + args);
  const auto dequantized = test::run_command(test::binary() + " generate --gguf-dequantize --checkpoint " + f + args);
  ASSERT_EQ(blocks.rc, 0) << blocks.out;
  ASSERT_EQ(by_default.rc, 0) << by_default.out;
  ASSERT_EQ(dequantized.rc, 0) << dequantized.out;
  auto tokens = [](const std::string& out) { return nlohmann::json::parse(out.substr(out.rfind("\n{") + 1)).at("tokens"); };
  EXPECT_EQ(tokens(by_default.out), tokens(blocks.out));
  EXPECT_EQ(tokens(blocks.out)[0].size(), tokens(dequantized.out)[0].size());
  EXPECT_NE(blocks.out.find("converted to fp32"), std::string::npos) << blocks.out;  // the small tensors, named
  EXPECT_EQ(by_default.out.find("dequantized into"), std::string::npos) << by_default.out;  // no fp32 copy written
  EXPECT_NE(dequantized.out.find("dequantized into"), std::string::npos) << dequantized.out;
  // An option only the dequantized weights run: the default follows it and says so; --gguf-blocks refuses it.
  const auto dtype_default = test::run_command(test::binary() + " generate --weight-dtype bf16 --checkpoint " + f + args);
  EXPECT_EQ(dtype_default.rc, 0) << dtype_default.out;
  EXPECT_NE(dtype_default.out.find("is dequantized at load: --weight-dtype bf16 needs the dequantized weights"),
            std::string::npos) << dtype_default.out;
  const auto dtype = test::run_command(test::binary() + " generate --gguf-blocks --weight-dtype bf16 --checkpoint " + f + args);
  EXPECT_NE(dtype.rc, 0);
  EXPECT_NE(dtype.out.find("--gguf-blocks: --weight-dtype bf16 needs the dequantized weights"), std::string::npos)
      << dtype.out;
  for (const char* flag : {"--gguf-blocks", "--gguf-dequantize"}) {
    const auto not_gguf =
        test::run_command(test::binary() + " generate " + flag + " --checkpoint " + parity("qwen3_next_L5") + args);
    EXPECT_NE(not_gguf.rc, 0) << flag;
    EXPECT_NE(not_gguf.out.find("is not one"), std::string::npos) << not_gguf.out;
  }
  const auto both = test::run_command(test::binary() + " generate --gguf-blocks --gguf-dequantize --checkpoint " + f + args);
  EXPECT_NE(both.rc, 0) << both.out;
}

// ---- bad files: the fixture rewritten by our writer with one thing wrong ----

using Edit = std::function<void(const std::string& name, std::vector<int64_t>& ne, uint32_t& type, bool& keep)>;

fs::path rewrite(const fs::path& out, const std::string& src, const Edit& edit,
                 const std::function<void(GgufWriter&)>& meta = nullptr) {
  auto r = std::make_shared<GgufReader>(src);
  GgufWriter w;
  for (const auto& [k, v] : r->metadata()) w.set(k, v);
  if (meta) meta(w);
  for (const TensorInfo& t : r->tensors()) {
    std::vector<int64_t> ne = t.ne;
    uint32_t type = t.type;
    bool keep = true;
    edit(t.name, ne, type, keep);
    if (!keep) continue;
    w.add_tensor(t.name, ne, type, [r, &t](std::span<std::byte> o) {
      const auto b = r->bytes(t);
      std::memcpy(o.data(), b.data(), std::min(o.size(), b.size()));
    });
  }
  w.write(out);
  return out;
}

std::string import_error(const fs::path& file) {
  TempDir tmp("bad");
  return test::error_of([&] { import_gguf(file, tmp.path); });
}

const Edit kNoEdit = [](const std::string&, std::vector<int64_t>&, uint32_t&, bool&) {};

TEST(GgufImportReject, TheUneditedRewriteImports) {
  TempDir d("rw");
  fs::create_directories(d.path);
  EXPECT_EQ(import_error(rewrite(d.path / "m.gguf", fixture("qwen3_5_L5.f32"), kNoEdit)), "(no exception)");
}

TEST(GgufImportReject, UnknownArchitecture) {
  TempDir d("arch");
  fs::create_directories(d.path);
  const std::string e = import_error(rewrite(d.path / "m.gguf", fixture("qwen3_5_L5.f32"), kNoEdit,
                                             [](GgufWriter& w) { w.set_string("general.architecture", "llama"); }));
  EXPECT_NE(e.find("architecture 'llama' is not supported"), std::string::npos) << e;
}

TEST(GgufImportReject, ShapeDisagreeingWithTheMetadataNamesTheTensor) {
  TempDir d("shape");
  fs::create_directories(d.path);
  const std::string e = import_error(rewrite(d.path / "m.gguf", fixture("qwen3_5_L5.f32"),
                                             [](const std::string& n, std::vector<int64_t>& ne, uint32_t&, bool&) {
                                               if (n == "blk.1.attn_gate.weight") ne[1] = 32;
                                             }));
  EXPECT_NE(e.find("tensor 'blk.1.attn_gate.weight' has shape [32, 64] but the metadata implies [64, 64]"),
            std::string::npos)
      << e;
}

TEST(GgufImportReject, TypeWithoutALoaderIsNamed) {
  TempDir d("type");
  fs::create_directories(d.path);
  const std::string e = import_error(rewrite(d.path / "m.gguf", fixture("qwen3_next_L5.f32"),
                                             [](const std::string& n, std::vector<int64_t>&, uint32_t& type, bool&) {
                                               if (n == "blk.2.ssm_out.weight") type = 3;  // Q4_1
                                             }));
  EXPECT_NE(e.find("tensor 'blk.2.ssm_out.weight' is stored as Q4_1, which hybridscan does not read"),
            std::string::npos)
      << e;
}

TEST(GgufImportReject, MissingTensorIsNamed) {
  TempDir d("missing");
  fs::create_directories(d.path);
  const std::string e = import_error(rewrite(d.path / "m.gguf", fixture("qwen3_next_L5.f32"),
                                             [](const std::string& n, std::vector<int64_t>&, uint32_t&, bool& keep) {
                                               keep = n != "blk.0.ssm_a";
                                             }));
  EXPECT_NE(e.find("tensor 'blk.0.ssm_a' is missing"), std::string::npos) << e;
}

TEST(GgufImportReject, TruncatedFileNamesTheLastTensor) {
  TempDir d("trunc");
  fs::create_directories(d.path);
  const fs::path f = d.path / "m.gguf";
  fs::copy_file(fixture("qwen3_next_L5.f32"), f);
  fs::resize_file(f, fs::file_size(f) - 100);
  const std::string e = import_error(f);
  EXPECT_NE(e.find("extends past the end"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
}

}  // namespace
}  // namespace hs::gguf

namespace hs::gguf {
namespace {

// Our writer against llama.cpp's converter on the same Hugging Face checkpoint: every tensor with the same name,
// type, shape and bytes. For f32 that proves the forward transforms (the inverse of the import's); for q8_0 also the
// choice of what stays F32 and ggml's Q8_0 rounding, byte for byte.
void expect_same_tensors(const fs::path& ours, const std::string& theirs) {
  const GgufReader a(ours), b(theirs);
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (const TensorInfo& t : b.tensors()) {
    const TensorInfo* u = a.find_tensor(t.name);
    ASSERT_TRUE(u) << t.name;
    EXPECT_EQ(u->ne, t.ne) << t.name;
    ASSERT_EQ(ggml_type_name(u->type), ggml_type_name(t.type)) << t.name;
    const auto x = a.bytes(*u), y = b.bytes(t);
    EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << t.name;
  }
  for (const char* key : {"general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre"})
    EXPECT_EQ(a.get_string(key), b.get_string(key)) << key;
  // Every numeric hyperparameter the converter wrote, with its value (llama.cpp reads them; a wrong rope section
  // changes its logits).
  const std::string arch = b.get_string("general.architecture");
  for (const auto& [key, v] : b.metadata()) {
    if (key.rfind(arch + ".", 0) != 0) continue;
    const Value* u = a.find(key);
    ASSERT_TRUE(u) << key;
    EXPECT_EQ(u->i, v.i) << key;
    EXPECT_EQ(u->f, v.f) << key;
    EXPECT_EQ(u->ints, v.ints) << key;
  }
}

class GgufExport : public ::testing::TestWithParam<std::string> {};

TEST_P(GgufExport, F32EqualsLlamaCppsConverterByteForByte) {
  TempDir tmp("export");
  fs::create_directories(tmp.path);
  export_gguf(parity(GetParam()), tmp.path / "m.gguf", QuantScheme::F32);
  expect_same_tensors(tmp.path / "m.gguf", fixture(GetParam() + ".f32"));
}

// With the MTP layer: block_count 6, nextn_predict_layers 1, recurrent_layers false for it, and its tensors (the
// full-attention layer with the MoE feed-forward, nextn.eh_proj and the three +1 norms) byte for byte.
INSTANTIATE_TEST_SUITE_P(Families, GgufExport,
                         ::testing::Values("qwen3_next_L5", "qwen3_5_L5", "qwen3_5_dense_L5", "qwen3_5_moe_mtp_L5"));

TEST(GgufExportQuantized, Q8_0EqualsLlamaCppsConverterByteForByte) {
  TempDir tmp("export_q8");
  fs::create_directories(tmp.path);
  export_gguf(parity("qwen3_next_L5"), tmp.path / "m.gguf", QuantScheme::Q8_0);
  expect_same_tensors(tmp.path / "m.gguf", fixture("qwen3_next_L5.q8_0"));
}

TEST(GgufExportQuantized, MixedKeepsTheSensitiveTensorsAtQ8_0) {
  EXPECT_EQ(tensor_type_for(QuantScheme::Mixed, "blk.3.attn_q.weight", 2048, 2), ggml_type::Q8_0);
  EXPECT_EQ(tensor_type_for(QuantScheme::Mixed, "blk.0.ssm_out.weight", 4096, 2), ggml_type::Q8_0);
  EXPECT_EQ(tensor_type_for(QuantScheme::Mixed, "blk.0.ffn_up_shexp.weight", 2048, 2), ggml_type::Q8_0);
  EXPECT_EQ(tensor_type_for(QuantScheme::Mixed, "token_embd.weight", 2048, 2), ggml_type::Q8_0);
  EXPECT_EQ(tensor_type_for(QuantScheme::Mixed, "output.weight", 2048, 2), ggml_type::Q8_0);
  EXPECT_EQ(tensor_type_for(QuantScheme::Mixed, "blk.0.ffn_up_exps.weight", 2048, 3), ggml_type::Q4_K);
  EXPECT_EQ(tensor_type_for(QuantScheme::Mixed, "blk.0.ffn_down_exps.weight", 512, 3), ggml_type::Q5_K);
  EXPECT_EQ(tensor_type_for(QuantScheme::Mixed, "blk.0.ffn_gate_inp.weight", 2048, 2), ggml_type::F32);
  EXPECT_EQ(tensor_type_for(QuantScheme::Q4_K, "blk.0.ffn_down_exps.weight", 64, 3), ggml_type::Q8_0);  // no 256 block
  EXPECT_EQ(tensor_type_for(QuantScheme::Q6_K, "blk.0.ssm_a", 32, 1), ggml_type::F32);
  EXPECT_THROW(parse_quant_scheme("q3_k"), std::invalid_argument);
}

// A round trip through our own quantizer: the mixed export of the parity model imports and generates (its rows of 64
// are not whole K-quant blocks, so they fall back to Q8_0; the K-quant formats are tests/quant_format_test.cpp's).
TEST(GgufExportQuantized, ExportImportRoundTripOfTheNativeCheckpointGenerates) {
  TempDir tmp("roundtrip");
  fs::create_directories(tmp.path);
  export_gguf(parity("qwen3_5_L5"), tmp.path / "m.gguf", QuantScheme::Mixed);
  const auto run = test::run_command(test::binary() + " generate --checkpoint " + (tmp.path / "m.gguf").string() +
                                     " --prompt-ids 1,2,3 --max-new-tokens 4 --temperature 0 --threads 1");
  EXPECT_EQ(run.rc, 0) << run.out;
}

}  // namespace
}  // namespace hs::gguf

namespace hs::gguf {
namespace {

nlohmann::json last_json_line(const std::string& out) {
  const size_t end = out.find_last_not_of('\n'), start = out.rfind('\n', end);
  return nlohmann::json::parse(out.substr(start == std::string::npos ? 0 : start + 1, end - start));
}

// plan --generate --gguf-dequantize of a .gguf equals what generate --gguf-dequantize measures on it (dequantized at
// load: fp32 weights), to the byte, and reports the file's own tensor bytes beside it. (From the blocks, the default:
// QuantPrefillCli.PlanEqualsWhatGenerateMeasures.)
TEST(GgufImportCli, PlanOfAGgufEqualsWhatGenerateMeasures) {
  const std::string f = fixture("qwen3_next_L5.q8_0");
  const auto g = test::run_command(test::binary() + " generate --gguf-dequantize --checkpoint " + f + " --prompt " +
                                    std::string(1100, 'a') + " --max-new-tokens 5 --json --weights-memory map 2>/dev/null");
  const auto p = test::run_command(test::binary() + " plan --generate --gguf-dequantize --model " + f +
                                    " --context 1104 --batch 1 --json 2>/dev/null");
  ASSERT_EQ(g.rc, 0) << g.out;
  ASSERT_EQ(p.rc, 0) << p.out;
  const auto gj = last_json_line(g.out), pj = last_json_line(p.out);
  EXPECT_EQ(gj["accounted_peak_bytes"].get<size_t>() + gj["weights_mapped_bytes"].get<size_t>(),
            pj["total_bytes"].get<size_t>());
  EXPECT_EQ(gj["weights_bytes"], pj["weights_bytes"]);
  EXPECT_EQ(pj["weights_run_as"], "f32");
  uint64_t file_tensor_bytes = 0;
  const GgufReader file(f);  // (named: a temporary's tensors() would dangle in the loop)
  for (const TensorInfo& t : file.tensors()) file_tensor_bytes += t.nbytes;
  EXPECT_EQ(pj["quantized_weights_bytes"].get<uint64_t>(), file_tensor_bytes);
}

// For a preset, the quantized bytes are those of the file convert --quantize writes.
TEST(GgufImportCli, PlanQuantizedBytesAreTheExportedFilesTensorBytes) {
  TempDir tmp("planq");
  fs::create_directories(tmp.path);
  export_gguf(parity("qwen3_5_L5"), tmp.path / "m.gguf", QuantScheme::Q8_0);
  uint64_t file_tensor_bytes = 0;
  const GgufReader written(tmp.path / "m.gguf");  // (named: a temporary's tensors() would dangle in the loop)
  for (const TensorInfo& t : written.tensors()) file_tensor_bytes += t.nbytes;
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(parity("qwen3_5_L5"));
  EXPECT_EQ(quantized_weight_bytes(d.config, QuantScheme::Q8_0), file_tensor_bytes);
}

}  // namespace
}  // namespace hs::gguf

namespace hs::gguf {
namespace {

// The real Qwen vocabularies (data/tokenizers, built by scripts/setup.sh) through tokenizer.ggml.* and back: the
// rebuilt tokenizer.json gives the original's ids on text with special tokens, newlines, digits and non-Latin
// scripts.
TEST(GgufImportTokenizer, RealQwenVocabulariesSurviveTheMetadata) {
  for (const std::string name : {"qwen2", "qwen3_5"}) {
    const fs::path dir = test::source_dir() + "/data/tokenizers/" + name;
    if (!fs::is_regular_file(dir / "tokenizer.json")) GTEST_SKIP() << dir << " is missing (run scripts/setup.sh)";
    const tokenizer::Tokenizer orig = tokenizer::Tokenizer::load((dir / "tokenizer.json").string());
    TempDir tmp("realtok_" + name);
    fs::create_directories(tmp.path);
    GgufWriter w;
    w.set_string("general.architecture", "qwen35");
    std::vector<std::string> notes;
    write_tokenizer(w, dir, orig.vocab_size(), notes);
    w.write(tmp.path / "t.gguf");
    const GgufReader r(tmp.path / "t.gguf");
    EXPECT_EQ(r.get_string("tokenizer.ggml.pre"), name == "qwen2" ? "qwen2" : "qwen35");
    const auto j = tokenizer_json_from_gguf(r);
    ASSERT_TRUE(j);
    {
      std::ofstream out(tmp.path / "tokenizer.json");
      out << j->dump();
    }
    const tokenizer::Tokenizer back = tokenizer::Tokenizer::load((tmp.path / "tokenizer.json").string());
    const std::string text =
        "<|im_start|>user\nIn the beginning God created the heaven and the earth. 1234567 don't\n\n  "
        "Ünïcödé テスト 中文 ١٢٣ 🙂<|im_end|>\n<|endoftext|>";
    EXPECT_EQ(back.encode(text), orig.encode(text)) << name;
    EXPECT_EQ(back.fingerprint(), orig.fingerprint()) << name;  // vocabulary, merges, added tokens, normaliser, regex
    EXPECT_EQ(back.vocab_size(), orig.vocab_size()) << name;
  }
}

}  // namespace
}  // namespace hs::gguf
