// What the ops' declarations of their two implementations name from outside src/ops, declared without including it:
// each <op>_args.hpp declares its CPU twin (host::, defined in src/host) and its CUDA launcher (kernels::, defined in
// src/kernels) next to its Args, so the floors above include one header per op. src/ops stays CUDA-free: cudaStream_t
// is `CUstream_st*` (CUDA's driver_types.h), the type the launchers' declarations use.
#pragma once

struct CUstream_st;

namespace flatep::host {
struct OpStats;  // host/op_stats.hpp: optional counters of the CPU twins of dispatch, dispatch_fp8 and combine
}  // namespace flatep::host
