#include "common/bf16.hpp"
#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/groups.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "ops/combine_grad_args.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // 16-byte chunks per lane in flight

// grad_y chunk: bf16_rne(a * weight) per element (__fmul_rn: one rounding, never contracted).
FLATEP_DEVICE uint4 scale_chunk(const float (&a)[8], float weight) {
    float scaled[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) scaled[e] = __fmul_rn(a[e], weight);
    return pack_bf16x8(scaled);
}

// One chunk into a lane's dot: elements in order, acc = acc + a * b with a separate multiply and add.
FLATEP_DEVICE float dot_chunk(float acc, const float (&a)[8], const uint4& bv) {
    float b[8];
    unpack_bf16x8(b, bv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = __fadd_rn(acc, __fmul_rn(a[e], b[e]));
    return acc;
}

// The lane sums' xor butterfly (offsets 16, 8, 4, 2, 1); every lane ends with lane 0's value.
FLATEP_DEVICE float warp_butterfly_sum(float v) {
#pragma unroll
    for (int offset = 16; offset >= 1; offset /= 2) v = __fadd_rn(v, __shfl_xor_sync(kFull, v, offset));
    return v;
}

template <bool kGradY, bool kGradWeights>
__global__ void __launch_bounds__(kThreads)
    combine_grad_kernel(Layout l, int rank, PlanView p, const uint16_t* rows, const uint16_t* y, const float* weights,
                        uint16_t* grad_y, float* grad_weights) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = int64_t(gridDim.x) * blockDim.x / 32;
    const int64_t n16 = l.row_bytes() / 16;
    for (int64_t r = warp; r < l.num_recv_rows; r += num_warps) {
        uint4* out_row = kGradY ? reinterpret_cast<uint4*>(grad_y) + r * n16 : nullptr;
        if (classify_row(l, p, rank, r) != kRowReal) {  // padding or past the end: zero, read nothing
            if constexpr (kGradY) warp_zero_v4(out_row, n16, lane);
            if constexpr (kGradWeights) {
                if (lane == 0) grad_weights[r] = 0.0f;
            }
            continue;
        }
        const uint4* a_row = reinterpret_cast<const uint4*>(rows) + r * n16;
        const uint4* b_row = kGradWeights ? reinterpret_cast<const uint4*>(y) + r * n16 : nullptr;
        const float weight = kGradY ? weights[r] : 0.0f;
        float acc = 0.0f;  // this lane's sum over its chunks lane, lane + 32, ... (ascending)
        for (int64_t i0 = 0; i0 < n16; i0 += 32 * kUnroll) {
            uint4 a[kUnroll], b[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int64_t i = i0 + 32 * u + lane;
                if (i < n16) {
                    a[u] = ld_v4(a_row + i);
                    if constexpr (kGradWeights) b[u] = ld_v4(b_row + i);
                }
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int64_t i = i0 + 32 * u + lane;
                if (i >= n16) continue;
                float av[8];
                unpack_bf16x8(av, a[u]);
                if constexpr (kGradY) st_v4(out_row + i, scale_chunk(av, weight));
                if constexpr (kGradWeights) acc = dot_chunk(acc, av, b[u]);
            }
        }
        if constexpr (kGradWeights) {
            acc = warp_butterfly_sum(acc);
            if (lane == 0) grad_weights[r] = acc;
        }
    }
}

// The one template dispatch: which outputs are computed.
template <bool kGradY, bool kGradWeights>
void launch_kernel(const CombineGradArgs& a, int blocks, cudaStream_t stream) {
    combine_grad_kernel<kGradY, kGradWeights>
        <<<blocks, kThreads, 0, stream>>>(a.layout, a.rank, a.plan, a.rows, a.y, a.weights, a.grad_y, a.grad_weights);
}

}  // namespace

void launch(const CombineGradArgs& a, cudaStream_t stream, int num_sms) {
    const int blocks = grid_blocks(num_sms, ceil_div(a.layout.num_recv_rows, kWarps), 4);
    if (a.grad_y != nullptr && a.grad_weights != nullptr) {
        launch_kernel<true, true>(a, blocks, stream);
    } else if (a.grad_y != nullptr) {
        launch_kernel<true, false>(a, blocks, stream);
    } else {
        launch_kernel<false, true>(a, blocks, stream);
    }
    FLATEP_CUDA_CHECK_LAUNCH();
}

FLATEP_PRELOAD_KERNELS(combine_grad_kernel<true, true>, combine_grad_kernel<true, false>,
                       combine_grad_kernel<false, true>);

}  // namespace flatep::kernels
