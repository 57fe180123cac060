// Portability macros shared by host-only and CUDA translation units, and the one warp-lane mask.
#pragma once

#if defined(__CUDACC__)
#define FLATEP_HD __host__ __device__ __forceinline__
#define FLATEP_DEVICE __device__ __forceinline__
#else
#define FLATEP_HD inline
#define FLATEP_DEVICE inline
#endif

#include "flatep/types.hpp"  // kMaxRanks, kMaxTopk

namespace flatep {

inline constexpr unsigned kFull = 0xffffffffu;  // every lane of a warp (the mask of the *_sync intrinsics)

}  // namespace flatep
