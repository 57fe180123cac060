// CUDA error checks for host code of the kernels library, tests and benchmarks: common/cuda.hpp (the planner and
// the runtime use them too).
#pragma once

#include "common/cuda.hpp"
