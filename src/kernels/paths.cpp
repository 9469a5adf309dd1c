#include "kernels/paths.h"

#include <sstream>

#include "core/settings.h"
#include "kernels/adamw.h"
#include "kernels/cpu.h"
#include "kernels/delta_rule.h"
#include "kernels/gemv.h"
#include "kernels/matmul.h"
#include "kernels/quant_gemv.h"

namespace hs::kernels {

std::string kernel_paths_report() {
  using cpu::allows;
  using cpu::Level;
  const bool bf16_on_onednn = matmul_bf16_on_onednn();  // makes the matmul runtime first: oneDNN is capped
  std::ostringstream o;
  o << "kernel paths:\n";
  o << "  matmul (oneDNN " << cpu::onednn_isa() << "): fp32 on oneDNN; bf16 "
    << (bf16_on_onednn ? "on oneDNN's bf16 kernels" : "widened to fp32 (oneDNN makes no bf16 product here)") << "\n";
  o << "  skinny products: " << cpu::level_name(skinny_level()) << "\n";
  o << "  gemv (decode): " << cpu::level_name(gemv_level()) << "\n";
  o << "  quantized gemv (decode, GGUF blocks): " << cpu::level_name(quant_gemv_level())
    << (quant_gemv_uses_vnni() ? " + vnni" : "") << "\n";
  o << "  delta rule: fp32 products " << (allows(Level::Avx512) ? "avx512" : "avx2") << "; --delta-rule-products bf16 "
    << (delta_rule_bf16_products_available() ? "on avx512_bf16" : "falls back to fp32 (no AVX-512-BF16)") << "\n";
  o << "  attention: "
    << (allows(Level::Avx512Bf16) ? (cpu::amx_tiles_enabled() ? "avx512_bf16 + amx tiles" : "avx512_bf16")
        : allows(Level::Avx512)   ? "avx512 (bf16 widened to fp32)"
                                  : "avx2 (bf16 widened to fp32)")
    << "\n";
  o << "  cached attention (decode): " << (allows(Level::Avx512) ? "avx512" : "avx2") << "\n";
  o << "  element-wise (norms, causal conv, SwiGLU rows): " << (allows(Level::Avx512) ? "avx512" : "avx2") << "\n";
  o << "  AdamW: " << cpu::level_name(adamw_level()) << "\n";
  o << "  bf16 rounding of activations: " << (allows(Level::Avx512Bf16) ? "avx512_bf16" : "avx2") << "\n";
  const std::string set = settings::describe_set();
  o << "settings (HS_*, docs/architecture.md):" << (set.empty() ? " none set\n" : "\n");
  std::istringstream lines(set);
  for (std::string line; std::getline(lines, line);) o << "  " << line << "\n";
  return o.str();
}

}  // namespace hs::kernels
