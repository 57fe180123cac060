#include "ops/grad_reduce_args.hpp"

#include <cstring>

#include "common/check.hpp"
#include "sync/barrier_host.hpp"

namespace flatep::host {

void run(const GradReduceArgs& a) {
    const int epn = a.experts_per_rank;
    const int64_t n = a.expert_elems;
    sync::host::barrier(a.sync, sync::kOpGradReduce);  // every replica's gradient is complete
    for (int g = 0; g < epn; ++g) {
        const int expert = a.rank * epn + g;
        float* grad = a.grads + int64_t(g) * n;
        for (int d = 0; d < a.num_ranks; ++d) {
            for (int j = 0; j < epn; ++j) {
                if (a.slot_expert[d * epn + j] != expert) continue;
                float* pool = a.reduce_pools[d] + int64_t(j) * n;
                for (int64_t i = 0; i < n; ++i) grad[i] = grad[i] + pool[i];
                std::memset(pool, 0, sizeof(float) * size_t(n));  // consumed: its owner zeroes it, as the kernel does
            }
        }
    }
    sync::host::barrier(
        a.sync, sync::kOpGradReduce);  // every owner has read and zeroed its sources before a holder writes them again
}

}  // namespace flatep::host
