// Compiled for plain x86-64 (CMakeLists.txt sets this file's flags): the start-up check below must run on a CPU
// that lacks the build's baseline, to say so instead of dying on an illegal instruction.
#include "kernels/cpu.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <sstream>
#include <stdexcept>
#include <string>

#include "core/settings.h"

namespace hs::kernels::cpu {
namespace {

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

Features read_features() {
  Features f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
  // XCR0: bits 1-2 the SSE and AVX state, 5-7 the AVX-512 opmask and upper registers, 17-18 AMX tile config/data.
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;
  f.avx = avx && os_avx;
  f.fma = fma && f.avx;
  f.f16c = f16c && f.avx;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = f.avx && (b & (1u << 5));
    f.avx512f = os_avx512 && (b & (1u << 16));
    f.avx512dq = f.avx512f && (b & (1u << 17));
    f.avx512bw = f.avx512f && (b & (1u << 30));
    f.avx512vl = f.avx512f && (b & (1u << 31));
    f.avx512_vnni = f.avx512f && (c & (1u << 11));
    f.amx_bf16 = os_amx && (d & (1u << 22));
    f.amx_tile = os_amx && (d & (1u << 24));
    f.amx_int8 = os_amx && (d & (1u << 25));
    const unsigned sub = a;  // leaf 7's highest subleaf
    if (sub >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      f.avx_vnni = f.avx && (a & (1u << 4));
      f.avx512_bf16 = f.avx512f && (a & (1u << 5));
    }
  }
  return f;
}

Level level_of(const Features& f) {
  if (!(f.avx2 && f.fma && f.f16c)) return static_cast<Level>(0);
  if (!(f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq)) return Level::Avx2;
  if (!f.avx512_bf16) return Level::Avx512;
  if (!(f.amx_tile && f.amx_bf16)) return Level::Avx512Bf16;
  return Level::Amx;
}

// Runs before the C++ initialisers of the program (priority 101; the default is 65535) and before main, in code
// compiled for plain x86-64: a CPU below the baseline gets a sentence, not SIGILL. Plain C only (no std::string):
// a template instantiated here could be merged at link time with a copy compiled for the baseline.
__attribute__((constructor(101))) void refuse_cpus_below_the_baseline() {
  const Features f = read_features();
  const char* names[4];
  int n = 0;
  if (!f.avx) names[n++] = "AVX (or the AVX register state, which the operating system must enable)";
  if (!f.avx2) names[n++] = "AVX2";
  if (!f.fma) names[n++] = "FMA";
  if (!f.f16c) names[n++] = "F16C";
  if (n == 0) return;
  std::fputs("hybridscan: this CPU lacks ", stderr);
  for (int i = 0; i < n; ++i) {
    if (i) std::fputs(", ", stderr);
    std::fputs(names[i], stderr);
  }
  std::fputs(". hybridscan needs an x86-64 CPU with AVX2, FMA and F16C (Intel Haswell, AMD Zen or later).\n", stderr);
  std::_Exit(1);
}

const char* cap_variable() {
  return settings::value(settings::Setting::MaxIsa);
}

}  // namespace

const char* level_name(Level l) {
  switch (l) {
    case Level::Scalar: return "scalar";
    case Level::Avx2: return "avx2";
    case Level::Avx512: return "avx512";
    case Level::Avx512Bf16: return "avx512_bf16";
    case Level::Amx: return "amx";
  }
  return "below-avx2";
}

bool parse_level(const std::string& s, Level& out) {
  for (Level l : {Level::Avx2, Level::Avx512, Level::Avx512Bf16, Level::Amx})
    if (s == level_name(l)) {
      out = l;
      return true;
    }
  return false;
}

const Features& detected() {
  static const Features f = read_features();
  return f;
}

Level detected_level() { return level_of(detected()); }

std::string cap_error() {
  const char* v = cap_variable();
  if (!v) return "";
  Level l;
  if (!parse_level(v, l))
    return "HS_MAX_ISA='" + std::string(v) + "' is not a level: use avx2, avx512, avx512_bf16 or amx (or unset it)";
  if (static_cast<int>(l) > static_cast<int>(detected_level()))
    return "HS_MAX_ISA=" + std::string(v) + " names more than this CPU has (it reaches " +
           level_name(detected_level()) + "): a cap can only take paths away; use " + level_name(detected_level()) +
           " or lower";
  return "";
}

namespace {
// The ScopedLevel in force (Amx: none).
std::atomic<int> g_scope{static_cast<int>(Level::Amx)};
}  // namespace

Level level() {
  static const Level capped = [] {
    Level d = detected_level();
    if (const char* v = cap_variable(); v && cap_error().empty()) {
      Level c;
      parse_level(v, c);
      if (static_cast<int>(c) < static_cast<int>(d)) d = c;
    }
    return d;
  }();
  const int scope = g_scope.load(std::memory_order_relaxed);
  return scope < static_cast<int>(capped) ? static_cast<Level>(scope) : capped;
}

ScopedLevel::ScopedLevel(Level l) : previous_(g_scope.load()) {
  if (!allows(l))
    throw std::invalid_argument(std::string("ScopedLevel(") + level_name(l) + "): above the level in force (" +
                                level_name(level()) + ")");
  g_scope.store(static_cast<int>(l));
}
ScopedLevel::~ScopedLevel() { g_scope.store(previous_); }

void apply_cap_to_onednn() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("ONEDNN_MAX_CPU_ISA") || std::getenv("DNNL_MAX_CPU_ISA")) return;  // the user's own choice
    if (!cap_variable()) return;
    dnnl::cpu_isa isa = dnnl::cpu_isa::all;
    switch (level()) {
      case Level::Scalar:  // a ScopedLevel's, never the cap's
      case Level::Avx2: isa = dnnl::cpu_isa::avx2; break;
      case Level::Avx512: isa = dnnl::cpu_isa::avx512_core; break;
      case Level::Avx512Bf16: isa = dnnl::cpu_isa::avx512_core_bf16; break;
      case Level::Amx: isa = dnnl::cpu_isa::all; break;
    }
    try {
      dnnl::set_max_cpu_isa(isa);
    } catch (const dnnl::error&) {
      // oneDNN had already looked at the ISA (a primitive made before this call): its cap can no longer change.
      std::fprintf(stderr, "hybridscan: warning: oneDNN started before HS_MAX_ISA could be applied to it\n");
    }
  });
}

std::string onednn_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: break;
  }
  return "other (" + std::to_string(static_cast<int>(dnnl::get_effective_cpu_isa())) + ")";
}

std::string model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown";
}

bool amx_tiles_enabled() {
  static const bool on = [] {
    if (!allows(Level::Amx)) return false;
#if defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return on;
}

std::string describe() {
  const Features& f = detected();
  std::ostringstream o;
  o << "cpu: " << model_name() << "\n  features:";
  const std::pair<bool, const char*> bits[] = {
      {f.avx2, "avx2"},         {f.fma, "fma"},           {f.f16c, "f16c"},         {f.avx512f, "avx512f"},
      {f.avx512bw, "avx512bw"}, {f.avx512vl, "avx512vl"}, {f.avx512dq, "avx512dq"}, {f.avx512_bf16, "avx512_bf16"},
      {f.avx512_vnni, "avx512_vnni"}, {f.avx_vnni, "avx_vnni"}, {f.amx_tile, "amx_tile"}, {f.amx_bf16, "amx_bf16"},
      {f.amx_int8, "amx_int8"}};
  for (const auto& [has, name] : bits)
    if (has) o << ' ' << name;
  o << "\n  level: " << level_name(level());
  if (level() != detected_level()) o << " (capped by HS_MAX_ISA; the CPU reaches " << level_name(detected_level()) << ")";
  return o.str();
}

}  // namespace hs::kernels::cpu
