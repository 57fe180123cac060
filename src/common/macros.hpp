// Portability macros shared by host-only and CUDA translation units.
#pragma once

#if defined(__CUDACC__)
#define FLATEP_HD __host__ __device__ __forceinline__
#define FLATEP_DEVICE __device__ __forceinline__
#else
#define FLATEP_HD inline
#define FLATEP_DEVICE inline
#endif

namespace flatep {

// Largest number of EP ranks any data-plane object supports (peer pointer arrays are this long).
inline constexpr int kMaxRanks = 64;
// Largest top-k.
inline constexpr int kMaxTopk = 32;

}  // namespace flatep
