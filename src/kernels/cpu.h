// What this CPU can do, decided once, and the one cap on it (HS_MAX_ISA). Every kernel family and every oneDNN
// primitive chooses its instruction set from here, so the engine never asks a CPU for an instruction it lacks, and a
// machine with AVX-512 can run exactly as a CPU with no more than AVX2 does (how the AVX2 paths are tested).
//
// The build's baseline is x86-64-v3 (AVX2, FMA, F16C, BMI1/2; CMakeLists.txt): code with no path of its own runs
// there. Wider paths (AVX-512F/BW/VL, AVX-512-BF16, AMX) are compiled into functions with target attributes and
// taken only when levels() says so. cpu.cpp itself is compiled for plain x86-64: it refuses, with a message naming
// what is missing, a CPU below the baseline before any other code of the program runs.
//
// Levels, each including the ones before it:
//   avx2         AVX2 + FMA + F16C                    (AMD Zen 1-3, Intel Haswell and later client parts)
//   avx512       + AVX-512 F/BW/VL/DQ                 (Intel Skylake-SP and later servers, AMD Zen 4/5)
//   avx512_bf16  + AVX-512-BF16 (vdpbf16ps, vcvtneps2bf16)  (Intel Cooper Lake, Sapphire Rapids; AMD Zen 4/5)
//   amx          + AMX-TILE + AMX-BF16                (Intel Sapphire Rapids and later)
// HS_MAX_ISA=avx2|avx512|avx512_bf16|amx caps the level; naming a level this CPU does not reach, or an unknown name,
// is an error (cap_error() says which). The cap is also handed to oneDNN (its own ONEDNN_MAX_CPU_ISA) before its
// first primitive: apply_cap_to_onednn().
#pragma once
#include <string>

// Brackets for code compiled once more for AVX-512 (F/BW/VL/DQ): a file includes its loops (a `*_paths.inc` that
// includes nothing itself, so no header's inline function is compiled wider than the baseline) once plainly and
// once between these, each time inside a namespace of its own, and calls the AVX-512 copy only when
// cpu::allows(Level::Avx512). Functions of the baseline that the copy calls are inlined into it and widened there.
#define HS_BEGIN_AVX512_PATHS _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq\")")
#define HS_END_ISA_PATHS _Pragma("GCC pop_options")
// In a function of a file that did so with namespaces NAME_avx2 and NAME_avx512: returns NAME_avx512::call where
// AVX-512 is allowed, else NAME_avx2::call (void calls too).
#define HS_RETURN_WIDEST(NAME, call)                                                                       \
  return ::hs::kernels::cpu::allows(::hs::kernels::cpu::Level::Avx512) ? NAME##_avx512::call : NAME##_avx2::call

namespace hs::kernels::cpu {

// The x86 feature bits the engine looks at, as this CPU and its operating system provide them (a register state
// the OS does not save counts as absent: XCR0 for AVX and AVX-512, the AMX permission for tiles).
struct Features {
  bool avx = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_vnni = false, avx_vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
};

// Scalar is below every CPU the program starts on: the plain C++ loops that gemv, AdamW and the skinny products keep
// as a second opinion, chosen only by tests and benchmarks (ScopedLevel).
enum class Level { Scalar = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3, Amx = 4 };

const char* level_name(Level l);           // "scalar", "avx2", "avx512", "avx512_bf16", "amx"
bool parse_level(const std::string& s, Level& out);  // a cap's level: avx2 and above

// The CPU as it is (no cap).
const Features& detected();
// The highest level the CPU reaches (Avx2 at least: the program does not start below it).
Level detected_level();
// The level every path chooses from: detected_level(), capped by HS_MAX_ISA (read once) and, while a ScopedLevel
// lives, by it. Every kernel family asks at each call, so a ScopedLevel reaches all of them (oneDNN excepted: it
// takes the cap once, before its first primitive).
Level level();
// Whether paths of level `l` may run (l <= level()).
inline bool allows(Level l) { return static_cast<int>(l) <= static_cast<int>(level()); }
// For tests and benchmarks: lowers level() to `l` for every thread while it lives, e.g. to run the AVX2 or the
// scalar path of a family on a wider CPU. Not to be created or ended while kernels run on other threads; throws
// std::invalid_argument when `l` is above level() (a scope can only take paths away).
class ScopedLevel {
 public:
  explicit ScopedLevel(Level l);
  ~ScopedLevel();
  ScopedLevel(const ScopedLevel&) = delete;
  ScopedLevel& operator=(const ScopedLevel&) = delete;

 private:
  int previous_;
};
// An empty string when HS_MAX_ISA is unset or valid, else what is wrong with it and how to fix it. level() treats a
// bad cap as absent; main() checks this first and stops (the test programs say it through Cpu.CapIsValid).
std::string cap_error();

// Hands the cap to oneDNN (dnnl::set_max_cpu_isa) unless ONEDNN_MAX_CPU_ISA is set already. Must run before
// oneDNN creates its first primitive (kernels/matmul.cpp calls it when its runtime is made); later calls do nothing.
void apply_cap_to_onednn();
// oneDNN's own ISA as it reports it (dnnl::get_effective_cpu_isa), e.g. "avx512_core_bf16".
std::string onednn_isa();

// The CPU's model name (/proc/cpuinfo), its features and the level, for --version and benchmark reports.
std::string model_name();
std::string describe();

// Whether the operating system lets this process use AMX tiles (asks Linux for the tile-data permission once).
bool amx_tiles_enabled();

}  // namespace hs::kernels::cpu
