// The x86 intrinsics header, for kernels with AVX-512 paths (each path is guarded by the compiler's feature
// macros and has a portable fallback, or, as in gemv.cpp, compiled with per-function target attributes and chosen
// at run time). GCC 12 warns on the self-initialised _mm512_undefined_ps() inside some intrinsics (shuffles,
// max/min, reductions); the diagnostics are located in the header itself, so the pragma has to cover its inclusion.
#pragma once

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
