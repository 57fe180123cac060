#include "ops/write_grads_args.hpp"

#include <cstring>

#include "common/bf16.hpp"

namespace flatep::host {

void run(const WriteGradsArgs& a) {
    const int64_t n = a.expert_elems;
    for (int g = 0; g < 2 * a.experts_per_rank; ++g) {
        float* dst = a.grads + int64_t(g) * n;
        switch (group_grad_action(a.experts_per_rank, a.slot_expert, a.cu_seqlens, g, a.accumulate)) {
            case kGradSkip:
                break;
            case kGradZero:
                std::memset(dst, 0, size_t(n) * sizeof(float));
                break;
            case kGradCopy:
                if (a.grad_bytes == 4) {
                    std::memcpy(dst, static_cast<const float*>(a.grad) + int64_t(g) * n, size_t(n) * sizeof(float));
                } else {
                    const uint16_t* src = static_cast<const uint16_t*>(a.grad) + int64_t(g) * n;
                    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
                }
                break;
            case kGradAdd:
                if (a.grad_bytes == 4) {
                    const float* src = static_cast<const float*>(a.grad) + int64_t(g) * n;
                    for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
                } else {
                    const uint16_t* src = static_cast<const uint16_t*>(a.grad) + int64_t(g) * n;
                    for (int64_t i = 0; i < n; ++i) dst[i] += bf16_to_float(src[i]);
                }
                break;
        }
    }
}

}  // namespace flatep::host
