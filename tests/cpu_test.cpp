// The one place that decides what this CPU runs (kernels/cpu.h): the cap HS_MAX_ISA, its errors, and every kernel
// family choosing no more than it allows. ctest runs the suite once more under HS_MAX_ISA=avx2 (label isa_avx2),
// where these checks pin every family to its AVX2 path.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>

#include "kernels/adamw.h"
#include "kernels/cpu.h"
#include "kernels/delta_rule.h"
#include "kernels/gemv.h"
#include "kernels/matmul.h"
#include "kernels/paths.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

test::CliRun run_cli(const std::string& env, const std::string& args) {
  return test::run_command(env + " " + std::string(HS_BINARY) + " " + args);
}

// Sets HS_MAX_ISA for one scope and puts back what was there.
class ScopedCap {
 public:
  explicit ScopedCap(const char* v) {
    if (const char* old = std::getenv("HS_MAX_ISA")) old_ = old, had_ = true;
    if (v) ::setenv("HS_MAX_ISA", v, 1);
    else ::unsetenv("HS_MAX_ISA");
  }
  ~ScopedCap() {
    if (had_) ::setenv("HS_MAX_ISA", old_.c_str(), 1);
    else ::unsetenv("HS_MAX_ISA");
  }

 private:
  std::string old_;
  bool had_ = false;
};

int rank(cpu::Level l) { return static_cast<int>(l); }

TEST(Cpu, LevelFollowsTheFeatureBits) {
  const cpu::Features& f = cpu::detected();
  // The program does not start below the baseline, so these hold wherever a test runs.
  EXPECT_TRUE(f.avx2 && f.fma && f.f16c);
  const cpu::Level d = cpu::detected_level();
  EXPECT_EQ(rank(d) >= rank(cpu::Level::Avx512), f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq);
  EXPECT_EQ(rank(d) >= rank(cpu::Level::Avx512Bf16), rank(d) >= rank(cpu::Level::Avx512) && f.avx512_bf16);
  EXPECT_EQ(rank(d) >= rank(cpu::Level::Amx), rank(d) >= rank(cpu::Level::Avx512Bf16) && f.amx_tile && f.amx_bf16);
  EXPECT_LE(rank(cpu::level()), rank(d));
  if (const char* cap = std::getenv("HS_MAX_ISA")) {
    cpu::Level c;
    ASSERT_TRUE(cpu::parse_level(cap, c)) << cap;
    EXPECT_EQ(rank(cpu::level()), std::min(rank(c), rank(d)));
  } else {
    EXPECT_EQ(cpu::level(), d);
  }
}

TEST(Cpu, LevelNamesRoundTrip) {
  for (cpu::Level l : {cpu::Level::Avx2, cpu::Level::Avx512, cpu::Level::Avx512Bf16, cpu::Level::Amx}) {
    cpu::Level back;
    ASSERT_TRUE(cpu::parse_level(cpu::level_name(l), back));
    EXPECT_EQ(back, l);
  }
  cpu::Level x;
  EXPECT_FALSE(cpu::parse_level("AVX2", x));  // names are lower case, as documented
  EXPECT_FALSE(cpu::parse_level("sse4", x));
  EXPECT_FALSE(cpu::parse_level("", x));
}

TEST(Cpu, CapErrorsSayWhatIsWrong) {
  {
    ScopedCap c(nullptr);
    EXPECT_EQ(cpu::cap_error(), "");
  }
  {
    ScopedCap c("avx2");
    EXPECT_EQ(cpu::cap_error(), "");
  }
  {
    ScopedCap c("avx1024");
    const std::string e = cpu::cap_error();
    EXPECT_NE(e.find("'avx1024' is not a level"), std::string::npos) << e;
    EXPECT_NE(e.find("avx2, avx512, avx512_bf16 or amx"), std::string::npos) << e;
  }
  if (cpu::detected_level() != cpu::Level::Amx) {
    ScopedCap c("amx");
    const std::string e = cpu::cap_error();
    EXPECT_NE(e.find("names more than this CPU has"), std::string::npos) << e;
    EXPECT_NE(e.find(std::string("reaches ") + cpu::level_name(cpu::detected_level())), std::string::npos) << e;
  }
}

// Every family takes no path above the level, and the widest one it has up to it.
TEST(Cpu, EveryKernelFamilyChoosesWithinTheLevel) {
  const cpu::Level l = cpu::level();
  const bool wide = rank(l) >= rank(cpu::Level::Avx512), bf16 = rank(l) >= rank(cpu::Level::Avx512Bf16);
  EXPECT_EQ(gemv_isa(), bf16 ? GemvIsa::Avx512Bf16 : wide ? GemvIsa::Avx512 : GemvIsa::Avx2);
  EXPECT_EQ(adamw_isa(), wide ? AdamWIsa::Avx512 : AdamWIsa::Avx2);
  EXPECT_EQ(skinny_isa_supported(SkinnyIsa::Avx512), wide);
  EXPECT_TRUE(skinny_isa_supported(SkinnyIsa::Avx2));
  EXPECT_EQ(gemv_isa_supported(GemvIsa::Avx512Bf16), bf16);
  EXPECT_EQ(adamw_isa_supported(AdamWIsa::Avx512), wide);
  if (!std::getenv("HS_DELTA_RULE_BF16_PRODUCTS")) {
    EXPECT_EQ(delta_rule_bf16_products_available(), bf16);
  }
  // oneDNN runs bf16 only with the BF16 instructions; the cap reached it (unless the user capped it directly).
  if (!std::getenv("ONEDNN_MAX_CPU_ISA")) {
    EXPECT_EQ(matmul_bf16_on_onednn(), bf16);
    if (!wide) {
      EXPECT_LE(static_cast<int>(dnnl::get_effective_cpu_isa()), static_cast<int>(dnnl::cpu_isa::avx2));
    }
  }
  const std::string report = kernel_paths_report();
  EXPECT_NE(report.find(std::string("gemv (decode): ") + gemv_isa_name(gemv_isa())), std::string::npos) << report;
}

TEST(Cpu, CommandLineRefusesABadCapAndPrintsThePaths) {
  const test::CliRun bad = run_cli("HS_MAX_ISA=avx1024", "--version");
  EXPECT_EQ(bad.rc, 2) << bad.out;
  EXPECT_NE(bad.out.find("hybridscan: error: HS_MAX_ISA='avx1024' is not a level"), std::string::npos) << bad.out;
  if (cpu::detected_level() != cpu::Level::Amx) {
    const test::CliRun above = run_cli("HS_MAX_ISA=amx", "train --help");
    EXPECT_EQ(above.rc, 2) << above.out;
    EXPECT_NE(above.out.find("names more than this CPU has"), std::string::npos) << above.out;
  }
  const test::CliRun capped = run_cli("HS_MAX_ISA=avx2", "--version");
  EXPECT_EQ(capped.rc, 0) << capped.out;
  for (const char* want : {"hybridscan ", "cpu: ", "level: avx2", "gemv (decode): avx2", "attention: avx2",
                           "bf16 widened to fp32", "AdamW: avx2", "matmul (oneDNN avx2)"})
    EXPECT_NE(capped.out.find(want), std::string::npos) << want << "\n" << capped.out;
  const test::CliRun plain = run_cli("env -u HS_MAX_ISA", "--version");
  EXPECT_EQ(plain.rc, 0) << plain.out;
  EXPECT_NE(plain.out.find(std::string("level: ") + cpu::level_name(cpu::detected_level())), std::string::npos)
      << plain.out;
}

}  // namespace
}  // namespace hs::kernels
