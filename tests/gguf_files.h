// GGUF files the quantized-decode and quantized-prefill tests share: a random `small` model written by our own
// exporter, the converter-made fixtures, and the Qwen3.5 parity model (the V-head reorder) at Q8_0.
#pragma once
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/convert.h"
#include "gguf/export.h"
#include "model/params.h"
#include "test_util.h"

namespace hs::test {

// A random `small` model (hidden 256: every matrix a whole number of Q4_K super-blocks) written as GGUF of `scheme`.
inline std::string small_gguf(const TempDir& t, gguf::QuantScheme scheme) {
  MemoryAccountant mem;
  model::ParamSet ps(model::preset("small"), DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 7);
  checkpoint::TrainingState st;
  st.params = &ps;
  st.state = nlohmann::json::object();
  const std::filesystem::path native = t / ("native." + gguf::quant_scheme_name(scheme));
  checkpoint::save_native(native, st);
  const std::filesystem::path out = t / ("small." + gguf::quant_scheme_name(scheme) + ".gguf");
  gguf::export_gguf(native, out, scheme);
  return out.string();
}

// tests/fixtures/gguf/NAME.gguf (written by llama.cpp's converter: scripts/make_gguf_fixtures.py).
inline std::string gguf_fixture(const std::string& name) {
  return source_dir() + "/tests/fixtures/gguf/" + name + ".gguf";
}

// Qwen3.5 (k_heads 2, v_heads 4: the V-head reorder) at Q8_0, from the parity fixture.
inline std::string qwen35_q8(const TempDir& t) {
  const std::filesystem::path out = t / "qwen3_5_L5.q8_0.gguf";
  gguf::export_gguf(source_dir() + "/tests/fixtures/parity/qwen3_5_L5", out, gguf::QuantScheme::Q8_0);
  return out.string();
}

}  // namespace hs::test
