// CPU twin of reduce_grad (design §3, §6).
#pragma once

#include "ops/grad_reduce_args.hpp"

namespace flatep::host {

// Runs rank args.rank's part; collective.
//   barrier; for each own expert g (id rank*epn + g): grads[g] = grads[g] + pool_d[j] for (d ascending, j ascending)
//   with slot_expert[d][j] == id, one fp32 add at a time, reading the peers' reduce pools; barrier;
//   every rank zeroes its consumed slots (slot_expert[rank][j] >= 0) in its own reduce pool.
void grad_reduce(const GradReduceArgs& args);

}  // namespace flatep::host
