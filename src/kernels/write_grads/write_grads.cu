#include "common/bf16.hpp"
#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"
#include "ops/write_grads_args.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 512;
constexpr int kVecElems = 8;  // elements per vector step

// 8 elements of the source as floats (exact conversion).
FLATEP_DEVICE void load8(float (&v)[8], const uint16_t* src) { unpack_bf16x8(v, *reinterpret_cast<const uint4*>(src)); }
FLATEP_DEVICE void load8(float (&v)[8], const float* src) {
    const float4 a = reinterpret_cast<const float4*>(src)[0], b = reinterpret_cast<const float4*>(src)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
FLATEP_DEVICE float load1(const uint16_t* src) { return bf16_to_float(*src); }
FLATEP_DEVICE float load1(const float* src) { return *src; }

// One work item: `step` (8 elements with kVec, else 1) of group g, converted / added / zeroed by `action`.
template <typename Src, bool kVec>
FLATEP_DEVICE void write_item(GroupGradAction action, const Src* src, float* dst, int64_t step) {
    if constexpr (kVec) {
        const int64_t i = step * kVecElems;
        float v[8] = {};
        if (action != kGradZero) load8(v, src + i);
        float4* out = reinterpret_cast<float4*>(dst + i);
        if (action == kGradAdd) {
            const float4 a = out[0], b = out[1];
            v[0] += a.x, v[1] += a.y, v[2] += a.z, v[3] += a.w, v[4] += b.x, v[5] += b.y, v[6] += b.z, v[7] += b.w;
        }
        out[0] = make_float4(v[0], v[1], v[2], v[3]);
        out[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else if (action == kGradAdd) {
        dst[step] += load1(src + step);
    } else {
        dst[step] = action == kGradCopy ? load1(src + step) : 0.0f;
    }
}

// kVec: expert_elems % 8 == 0 and 16-byte aligned bases, so every group starts 16-byte aligned in both arrays.
// The 2*epn groups' steps form one index space (group g's steps at [g*steps, (g+1)*steps)) that the grid walks
// grid-stride: every thread gets the same share of the whole projection whatever the groups' sizes against the grid
// (a walk per group left the threads past a group's last full stride idle once per group). A thread carries its
// position (group, step) from item to item without a division, and leaves a skipped group (no rows, unused slot)
// in one jump.
template <typename Src, bool kVec>
__global__ void __launch_bounds__(kThreads)
    write_grads_kernel(int epn, int64_t n, const int32_t* slot_expert, const int32_t* cu_seqlens,
                       const Src* __restrict__ grad, float* __restrict__ grads, bool accumulate) {
    const int64_t steps = kVec ? n / kVecElems : n;  // per group
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    const int num_groups = 2 * epn;
    int64_t step = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // within group g
    int g = 0;
    GroupGradAction action = kGradSkip;
    int action_of = -1;  // the group `action` belongs to
    while (true) {
        while (g < num_groups && step >= steps) step -= steps, ++g;
        if (g >= num_groups) break;
        if (action_of != g) {
            action = group_grad_action(epn, slot_expert, cu_seqlens, g, accumulate);
            action_of = g;
        }
        if (action == kGradSkip) {  // to this thread's first item past the group
            step += ceil_div<int64_t>(steps - step, stride) * stride;
            continue;
        }
        write_item<Src, kVec>(action, grad + int64_t(g) * n, grads + int64_t(g) * n, step);
        step += stride;
    }
}

template <typename Src>
void launch_typed(const WriteGradsArgs& a, cudaStream_t stream, int num_sms) {
    const bool vec = a.expert_elems % kVecElems == 0 && reinterpret_cast<uintptr_t>(a.grad) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(a.grads) % 16 == 0;
    const int64_t steps = (vec ? a.expert_elems / kVecElems : a.expert_elems) * 2 * a.experts_per_rank;  // all groups
    const int blocks = grid_blocks(num_sms, ceil_div<int64_t>(steps, kThreads), 4);
    const auto* grad = static_cast<const Src*>(a.grad);
    if (vec) {
        write_grads_kernel<Src, true><<<blocks, kThreads, 0, stream>>>(
            a.experts_per_rank, a.expert_elems, a.slot_expert, a.cu_seqlens, grad, a.grads, a.accumulate);
    } else {
        write_grads_kernel<Src, false><<<blocks, kThreads, 0, stream>>>(
            a.experts_per_rank, a.expert_elems, a.slot_expert, a.cu_seqlens, grad, a.grads, a.accumulate);
    }
}

}  // namespace

void launch(const WriteGradsArgs& a, cudaStream_t stream, int num_sms) {
    if (a.grad_bytes == 2) {
        launch_typed<uint16_t>(a, stream, num_sms);
    } else {
        launch_typed<float>(a, stream, num_sms);
    }
    FLATEP_CUDA_CHECK_LAUNCH();
}

FLATEP_PRELOAD_KERNELS(write_grads_kernel<uint16_t, true>, write_grads_kernel<uint16_t, false>,
                       write_grads_kernel<float, true>, write_grads_kernel<float, false>);

}  // namespace flatep::kernels
