// CPU twin of combine (design §3, §6). Numerics, which every CUDA kernel must reproduce bitwise:
//   destination, per chain (one per (source, token) on this rank) with head row h, over each element:
//     acc = 0.0f; for r along the chain (ascending k): acc = weights ? fma(weights[r], y[r], acc) : acc + y[r];
//     partial[h] = bf16(acc)
//   source, per token t: acc = 0.0f; for d ascending with entries of t: acc += float(partial_d[head row of t on d]);
//     out[t] = bf16(acc)   (a token without any valid entry gets a zero row)
// src/host is compiled with -ffp-contract=off so the compiler never fuses the unweighted adds.
#pragma once

#include "host/op_stats.hpp"
#include "ops/combine_args.hpp"

namespace flatep::host {

// Runs rank args.rank's part; collective. Barriers: entry, then between the destination and source sides.
void combine(const CombineArgs& args, OpStats* stats = nullptr);

}  // namespace flatep::host
