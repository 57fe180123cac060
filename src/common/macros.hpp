// Portability macros shared by host-only and CUDA translation units.
#pragma once

#if defined(__CUDACC__)
#define FLATEP_HD __host__ __device__ __forceinline__
#define FLATEP_DEVICE __device__ __forceinline__
#else
#define FLATEP_HD inline
#define FLATEP_DEVICE inline
#endif

#include "flatep/types.hpp"  // kMaxRanks, kMaxTopk
