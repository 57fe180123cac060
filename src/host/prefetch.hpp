// CPU twin of prefetch (design §3, §5): owners push the weights of this step's replicas into the slot pools.
#pragma once

#include "ops/prefetch_args.hpp"

namespace flatep::host {

// Runs rank args.rank's part; collective. barrier; for every rank d and slot j whose expert
// slot_expert[d][j] is owned by this rank, copy that expert's weights into d's slot pool at slot j; barrier.
void prefetch(const PrefetchArgs& args);

}  // namespace flatep::host
