#include "core/settings.h"

#include <cstdlib>

namespace hs::settings {

const std::vector<Info>& all() {
  static const std::vector<Info> table = {
      {Setting::MaxIsa, "HS_MAX_ISA",
       "avx2|avx512|avx512_bf16|amx: caps the CPU level every kernel and oneDNN choose from (kernels/cpu.h); unset: "
       "the CPU's own"},
      {Setting::PackedWeights, "HS_PACKED_WEIGHTS",
       "on|off: the default of --packed-weights (weights kept in oneDNN's packed layout); unset: off"},
      {Setting::DeltaRuleBf16Products, "HS_DELTA_RULE_BF16_PRODUCTS",
       "off: the delta rule's bf16 products fall back to fp32 even where the CPU has them (for tests); unset: on"},
      {Setting::GemvPrefetch, "HS_GEMV_PREFETCH",
       "N: gemv prefetches N weight blocks ahead on every path (for measuring); unset: 2 for the 2x8 and 3x8 "
       "blocks, none elsewhere"},
      {Setting::DecodeFused, "HS_DECODE_FUSED", "0: decode through the layered path, not the fused step; unset: fused"},
      {Setting::FusedSpin, "HS_FUSED_SPIN",
       "N: pause instructions before a waiting thread of the fused decode step sleeps; unset: 2000"},
      {Setting::MpiTimeoutS, "HS_MPI_TIMEOUT_S",
       "seconds: how long an MPI collective may wait for the other ranks before the run stops with an error; unset: 300"},
      {Setting::Profile, "HS_PROFILE", "1: time every phase of a run (as --profile); unset or 0: off"},
  };
  return table;
}

const char* name(Setting s) {
  for (const Info& i : all())
    if (i.setting == s) return i.name;
  return "HS_?";
}

const char* value(Setting s) {
  const char* v = std::getenv(name(s));
  return v && *v ? v : nullptr;
}

std::string describe_set() {
  std::string out;
  for (const Info& i : all())
    if (const char* v = value(i.setting)) out += std::string(i.name) + "=" + v + "\n";
  return out;
}

}  // namespace hs::settings
