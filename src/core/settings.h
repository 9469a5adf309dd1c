// Every HS_* environment variable the engine reads, in one table (settings.cpp): its name, what it does and its
// default, read through here alone. docs/architecture.md ("Settings") is the same table for readers, with the
// build's and the scripts' own variables; `hybridscan --version` prints the ones that are set.
#pragma once
#include <string>
#include <vector>

namespace hs::settings {

enum class Setting {
  MaxIsa,                 // HS_MAX_ISA
  PackedWeights,          // HS_PACKED_WEIGHTS
  DeltaRuleBf16Products,  // HS_DELTA_RULE_BF16_PRODUCTS
  GemvPrefetch,           // HS_GEMV_PREFETCH
  DecodeFused,            // HS_DECODE_FUSED
  FusedSpin,              // HS_FUSED_SPIN
  MpiTimeoutS,            // HS_MPI_TIMEOUT_S
  Profile,                // HS_PROFILE
};

struct Info {
  Setting setting;
  const char* name;      // "HS_MAX_ISA"
  const char* meaning;   // one line: what it does, its values and its default
};
const std::vector<Info>& all();
const char* name(Setting s);

// The variable's value now, nullptr when unset or empty. Read at each call (a test may change it); a caller that
// must not change its mind mid-run keeps the first value. Compiled for plain x86-64 like kernels/cpu.cpp, which
// reads HS_MAX_ISA through it before the CPU check has run.
const char* value(Setting s);

// "HS_NAME=value" for each setting that is set, one per line (empty when none is).
std::string describe_set();

}  // namespace hs::settings
