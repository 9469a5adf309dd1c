// The one place that decides what this CPU runs (kernels/cpu.h): the cap HS_MAX_ISA, its errors, and every kernel
// family choosing no more than it allows. scripts/test.sh runs the whole suite once more under HS_MAX_ISA=avx2, where
// these checks pin every family to its AVX2 path.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>
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
  return test::run_command(env + " " + hs::test::binary() + " " + args);
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
  if (const char* cap = std::getenv("HS_MAX_ISA"); cap && *cap) {
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
  EXPECT_EQ(gemv_level(), bf16 ? cpu::Level::Avx512Bf16 : wide ? cpu::Level::Avx512 : cpu::Level::Avx2);
  EXPECT_EQ(adamw_level(), wide ? cpu::Level::Avx512 : cpu::Level::Avx2);
  EXPECT_EQ(skinny_level(), wide ? cpu::Level::Avx512 : cpu::Level::Avx2);
  if (!std::getenv("HS_DELTA_RULE_BF16_PRODUCTS")) {
    EXPECT_EQ(delta_rule_bf16_products_available(), bf16);
  }
  // oneDNN runs bf16 only with the BF16 instructions; the cap reached it (unless the user capped it directly).
  if (!std::getenv("ONEDNN_MAX_CPU_ISA")) {
    EXPECT_EQ(matmul_bf16_on_onednn(), bf16);
    if (!wide) {  // AVX2 or AVX2-VNNI (Intel client parts from Alder Lake on): nothing of AVX-512
      const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
      EXPECT_TRUE(isa == dnnl::cpu_isa::avx2 || isa == dnnl::cpu_isa::avx2_vnni) << cpu::onednn_isa();
    }
  }
  const std::string report = kernel_paths_report();
  EXPECT_NE(report.find(std::string("gemv (decode): ") + cpu::level_name(gemv_level())), std::string::npos) << report;
}

// A ScopedLevel lowers every family's choice while it lives (how the tests run each path of a wider CPU), never
// raises it, and ends where it began.
TEST(Cpu, ScopedLevelLowersEveryFamilyAndEnds) {
  const cpu::Level before = cpu::level();
  const cpu::Level gemv_before = gemv_level();
  {
    cpu::ScopedLevel avx2(cpu::Level::Avx2);
    EXPECT_EQ(cpu::level(), cpu::Level::Avx2);
    EXPECT_EQ(gemv_level(), cpu::Level::Avx2);
    EXPECT_EQ(adamw_level(), cpu::Level::Avx2);
    EXPECT_EQ(skinny_level(), cpu::Level::Avx2);
    EXPECT_FALSE(delta_rule_bf16_products_available());
    EXPECT_NE(kernel_paths_report().find("gemv (decode): avx2"), std::string::npos) << kernel_paths_report();
    {
      cpu::ScopedLevel scalar(cpu::Level::Scalar);
      EXPECT_EQ(gemv_level(), cpu::Level::Scalar);
      EXPECT_EQ(adamw_level(), cpu::Level::Scalar);
      EXPECT_EQ(skinny_level(), cpu::Level::Scalar);
      EXPECT_THROW(cpu::ScopedLevel raise(cpu::Level::Avx2), std::invalid_argument);
    }
    EXPECT_EQ(cpu::level(), cpu::Level::Avx2);
    if (before != cpu::Level::Avx2) {
      EXPECT_THROW(cpu::ScopedLevel raise(before), std::invalid_argument);
    }
  }
  EXPECT_EQ(cpu::level(), before);
  EXPECT_EQ(gemv_level(), gemv_before);
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
                           "bf16 widened to fp32", "AdamW: avx2", "matmul (oneDNN avx2",
                           "element-wise (norms, causal conv, SwiGLU rows): avx2"})
    EXPECT_NE(capped.out.find(want), std::string::npos) << want << "\n" << capped.out;
  const test::CliRun plain = run_cli("env -u HS_MAX_ISA", "--version");
  EXPECT_EQ(plain.rc, 0) << plain.out;
  EXPECT_NE(plain.out.find(std::string("level: ") + cpu::level_name(cpu::detected_level())), std::string::npos)
      << plain.out;
}

}  // namespace
}  // namespace hs::kernels

namespace hs::kernels {
namespace {

// A bad HS_MAX_ISA in the test environment would otherwise run the suite silently uncapped.
TEST(Cpu, CapIsValid) { EXPECT_EQ(cpu::cap_error(), ""); }

// bf16 products large enough to cross every block of the widened path (kernels/matmul.cpp run_widened: blocks of K,
// N and M of at most 1 MiB of fp32 each) in each layout the engine uses, with leading dimensions wider than the
// shape, fp32 and bf16 outputs, with and without accumulation; against a double reference. Where oneDNN has bf16
// products (AVX-512-BF16, uncapped) the same shapes run there, under the same bound. The bound: every path sums the
// exact products of bf16 inputs in fp32, in blocks whose partial sums add into C, so |C - exact| <= (K + 2) 2^-24
// (sum_k |a_k b_k| + |C_old|); a bf16 output then rounds once more, 2^-8 of its magnitude.
TEST(Cpu, WidenedBf16ProductsCrossEveryBlock) {
  struct Case {
    int64_t M, N, K;
    bool ta, tb;
  };
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const Case c : {Case{600, 2000, 4096, false, true}, Case{300, 300, 5000, true, false},
                       Case{520, 1100, 1500, false, false}})
    for (int out_bf16 = 0; out_bf16 < 2; ++out_bf16)
      for (int acc = 0; acc < 2; ++acc) {
        const int64_t a_rows = c.ta ? c.K : c.M, a_cols = c.ta ? c.M : c.K, lda = a_cols + 24;
        const int64_t b_rows = c.tb ? c.N : c.K, b_cols = c.tb ? c.K : c.N, ldb = b_cols + 40;
        const int64_t ldc = c.N + 8;
        std::vector<bf16> A(static_cast<size_t>(a_rows * lda)), B(static_cast<size_t>(b_rows * ldb));
        for (auto& v : A) v = from_f32<bf16>(nd(rng));
        for (auto& v : B) v = from_f32<bf16>(nd(rng));
        std::vector<float> Cf(static_cast<size_t>(c.M * ldc));
        std::vector<bf16> Cb(Cf.size());
        for (size_t i = 0; i < Cf.size(); ++i) {
          Cb[i] = from_f32<bf16>(nd(rng));
          Cf[i] = to_f32(Cb[i]);
        }
        const std::vector<float> old = Cf;
        const MatmulLayout ld{lda, ldb, ldc, false};
        if (out_bf16) matmul(A.data(), B.data(), Cb.data(), c.M, c.N, c.K, c.ta, c.tb, acc != 0, ld);
        else matmul(A.data(), B.data(), Cf.data(), c.M, c.N, c.K, c.ta, c.tb, acc != 0, ld);
        int64_t bad = 0;
        double worst = 0;
        for (int64_t i = 0; i < c.M; i += 7)  // a sample of rows and columns, every block among them
          for (int64_t j = 0; j < c.N; j += 5) {
            double s = acc ? old[static_cast<size_t>(i * ldc + j)] : 0.0, mag = acc ? std::fabs(s) : 0.0;
            for (int64_t k = 0; k < c.K; ++k) {
              const double a = to_f32(c.ta ? A[static_cast<size_t>(k * lda + i)] : A[static_cast<size_t>(i * lda + k)]);
              const double b = to_f32(c.tb ? B[static_cast<size_t>(j * ldb + k)] : B[static_cast<size_t>(k * ldb + j)]);
              s += a * b;
              mag += std::fabs(a * b);
            }
            const double got = out_bf16 ? to_f32(Cb[static_cast<size_t>(i * ldc + j)]) : Cf[static_cast<size_t>(i * ldc + j)];
            const double bound = (c.K + 2) * std::ldexp(1.0, -24) * mag + (out_bf16 ? std::ldexp(1.0, -8) * std::fabs(s) : 0.0);
            worst = std::max(worst, std::fabs(got - s) / bound);
            bad += std::fabs(got - s) > bound;
          }
        EXPECT_EQ(bad, 0) << c.M << "x" << c.N << "x" << c.K << " ta " << c.ta << " tb " << c.tb << " bf16 out "
                          << out_bf16 << " acc " << acc << " worst err/bound " << worst;
        // Nothing outside the shape is written (leading dimensions wider than it).
        for (int64_t i = 0; i < c.M; ++i)
          for (int64_t j = c.N; j < ldc; ++j)
            if (out_bf16) EXPECT_EQ(Cb[static_cast<size_t>(i * ldc + j)].bits, from_f32<bf16>(old[static_cast<size_t>(i * ldc + j)]).bits);
            else EXPECT_EQ(Cf[static_cast<size_t>(i * ldc + j)], old[static_cast<size_t>(i * ldc + j)]);
      }
}

}  // namespace
}  // namespace hs::kernels
