#include "host/grad_reduce.hpp"

#include <cstring>

#include "common/check.hpp"
#include "sync/barrier_host.hpp"

namespace flatep::host {

void grad_reduce(const GradReduceArgs& a) {
    const int epn = a.experts_per_rank;
    const int64_t n = a.expert_elems;
    FLATEP_CHECK(a.grads != nullptr, "reduce_grad: grads is null");
    barrier(a.sync, kOpGradReduce);  // every replica's gradient is complete
    for (int g = 0; g < epn; ++g) {
        const int expert = a.rank * epn + g;
        float* grad = a.grads + int64_t(g) * n;
        for (int d = 0; d < a.num_ranks; ++d) {
            for (int j = 0; j < epn; ++j) {
                if (a.slot_expert[d * epn + j] != expert) continue;
                const float* pool = a.reduce_pools[d] + int64_t(j) * n;
                for (int64_t i = 0; i < n; ++i) grad[i] = grad[i] + pool[i];
            }
        }
    }
    barrier(a.sync, kOpGradReduce);  // every owner has read the pools
    float* own_pool = a.reduce_pools[a.rank];
    for (int j = 0; j < epn; ++j) {
        if (a.slot_expert[a.rank * epn + j] >= 0) std::memset(own_pool + int64_t(j) * n, 0, sizeof(float) * size_t(n));
    }
}

}  // namespace flatep::host
