// Which path each kernel family takes on this CPU under HS_MAX_ISA (kernels/cpu.h), for `hybridscan --version`
// and benchmark reports.
#pragma once
#include <string>

namespace hs::kernels {

// One line per family: "  name: path (why)". Asks oneDNN whether it makes bf16 products, so call it after the
// cap has been applied (any call does: the matmul runtime applies it first).
std::string kernel_paths_report();

// Whether a bf16 product runs on oneDNN's bf16 kernels (false: its operands are widened to fp32, kernels/matmul.cpp).
bool matmul_bf16_on_onednn();

}  // namespace hs::kernels
