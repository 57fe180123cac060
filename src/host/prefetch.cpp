#include "ops/prefetch_args.hpp"

#include <cstring>

#include "common/check.hpp"
#include "layout/layout.hpp"
#include "sync/barrier_host.hpp"

namespace flatep::host {

void run(const PrefetchArgs& a) {
    const int epn = a.experts_per_rank;
    if (a.pull) {
        if (!a.plan_ordered) sync::host::barrier(a.sync, sync::kOpPrefetch);  // the owners' weights are final
        for (int p = 0; p < a.num_projections; ++p) {
            const PrefetchProjection& pr = a.projections[p];
            for (int j = 0; j < a.num_slots; ++j) {
                const int expert = a.slot_expert[a.rank * epn + j];
                if (expert < 0) continue;
                std::memcpy(pr.slot_pools[a.rank] + int64_t(j) * pr.expert_bytes,
                            pr.owners[home_rank(expert, epn)] + int64_t(local_expert(expert, epn)) * pr.expert_bytes,
                            size_t(pr.expert_bytes));
            }
        }
        return;  // only this rank's slots were written, and its own stream orders the GEMM after them
    }
    sync::host::barrier(a.sync, sync::kOpPrefetch);  // destinations are done computing with their previous slots
    for (int p = 0; p < a.num_projections; ++p) {
        const PrefetchProjection& pr = a.projections[p];
        for (int d = 0; d < a.num_ranks; ++d) {
            for (int j = 0; j < a.num_slots; ++j) {
                const int expert = a.slot_expert[d * epn + j];
                if (expert < 0 || home_rank(expert, epn) != a.rank) continue;
                std::memcpy(pr.slot_pools[d] + int64_t(j) * pr.expert_bytes,
                            pr.weights + int64_t(local_expert(expert, epn)) * pr.expert_bytes, size_t(pr.expert_bytes));
            }
        }
    }
    sync::host::barrier(a.sync, sync::kOpPrefetch);  // every slot is filled before anyone computes with it
}

}  // namespace flatep::host
