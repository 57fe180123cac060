#include "kernels/ffn_rows/ffn_rows.cuh"

#include "common/bf16.hpp"
#include "common/math.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vector.cuh"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 256;
// Resident blocks an SM (1536 threads): the launch bounds hold the swiglu kernel to 40 registers without spills, and
// the grid is never larger than what stays resident.
constexpr int kBlocksPerSm = 6;
constexpr int kWordElems = 8;  // bf16 in one 16-byte word

// The rows below the last group end: *end (written by an earlier kernel of the stream) clamped to [0, rows].
FLATEP_DEVICE int64_t rows_below_end(const int32_t* end, int64_t rows) {
    const int64_t e = *end;
    return e < 0 ? 0 : (e > rows ? rows : e);
}

// silu in fp32 as PyTorch's CUDA kernel computes it for fp32 input: x / (1 + exp(-x)) with the accurate expf and
// IEEE division (the library builds without fast math). The kernels are compiled with --fmad=false, so the add after
// expf stays an add where a build with fmad on (torch's) may contract it with expf's last step, a multiply by a power
// of two, into one fma (nvcc 13 does). That product is exact unless it overflows (both then give inf) or falls below
// 2^-126 (1 + it then rounds to 1 either way), so both give the same bits.
FLATEP_DEVICE float silu(float x) { return x / (1.0f + expf(-x)); }

// One output value in fp32 (rounded to bf16 by the caller): silu(gate) * up (swiglu) or silu(gate) (silu), the fp32
// values flatep.ffn.activate forms before its .to(bfloat16).
template <bool kSwiglu>
FLATEP_DEVICE float activation_value(float gate, float up) {
    if constexpr (kSwiglu) {
        return silu(gate) * up;
    } else {
        return silu(gate);
    }
}

// 16-byte kernel: item i is output word i (8 values of row i / words_per_row). The first loop covers the items of the
// rows below the end (reading h), the second the rest (zero stores only, when zero_past_end); each is a grid-stride
// walk from the thread's index, so a block whose items all lie past the end does no loads at all.
template <bool kSwiglu>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    activate_rows_vec_kernel(const uint16_t* __restrict__ h, uint16_t* __restrict__ a, int64_t rows, int64_t ffn,
                             const int32_t* end, bool zero_past_end) {
    const int64_t words_per_row = ffn / kWordElems;
    const int64_t h_cols = kSwiglu ? 2 * ffn : ffn;
    const int64_t live = rows_below_end(end, rows) * words_per_row;
    const int64_t total = zero_past_end ? rows * words_per_row : live;
    const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    uint4* const out = reinterpret_cast<uint4*>(a);
    for (int64_t i = first; i < live; i += stride) {
        const int64_t r = i / words_per_row;
        const uint16_t* const gate = h + r * h_cols + (i - r * words_per_row) * kWordElems;
        float g[kWordElems], u[kWordElems], v[kWordElems];
        unpack_bf16x8(g, *reinterpret_cast<const uint4*>(gate));
        if constexpr (kSwiglu) unpack_bf16x8(u, *reinterpret_cast<const uint4*>(gate + ffn));
#pragma unroll
        for (int k = 0; k < kWordElems; ++k) v[k] = activation_value<kSwiglu>(g[k], kSwiglu ? u[k] : 0.0f);
        out[i] = pack_bf16x8(v);
    }
    for (int64_t i = live + first; i < total; i += stride) out[i] = make_uint4(0, 0, 0, 0);
}

// Element kernel (ffn % 8 != 0 or unaligned pointers): item i is output element i, loops as the 16-byte kernel's.
template <bool kSwiglu>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    activate_rows_scalar_kernel(const uint16_t* __restrict__ h, uint16_t* __restrict__ a, int64_t rows, int64_t ffn,
                                const int32_t* end, bool zero_past_end) {
    const int64_t h_cols = kSwiglu ? 2 * ffn : ffn;
    const int64_t live = rows_below_end(end, rows) * ffn;
    const int64_t total = zero_past_end ? rows * ffn : live;
    const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = first; i < live; i += stride) {
        const int64_t r = i / ffn;
        const uint16_t* const gate = h + r * h_cols + (i - r * ffn);
        const float up = kSwiglu ? bf16_to_float(gate[ffn]) : 0.0f;
        a[i] = float_to_bf16(activation_value<kSwiglu>(bf16_to_float(*gate), up));
    }
    for (int64_t i = live + first; i < total; i += stride) a[i] = 0;
}

// Zeroes items [rows_below_end * per_row, rows * per_row) of y: 16-byte words (kVec) or elements.
template <bool kVec>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    zero_rows_from_end_kernel(uint16_t* __restrict__ y, int64_t rows, int64_t per_row, const int32_t* end) {
    const int64_t total = rows * per_row;
    const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = rows_below_end(end, rows) * per_row + first; i < total; i += stride) {
        if constexpr (kVec) {
            reinterpret_cast<uint4*>(y)[i] = make_uint4(0, 0, 0, 0);
        } else {
            y[i] = 0;
        }
    }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

void launch_activate_rows(const uint16_t* h, uint16_t* a, int64_t rows, int64_t ffn, FfnActivation activation,
                          const int32_t* end, bool zero_past_end, cudaStream_t stream, int num_sms) {
    if (rows == 0) return;
    const bool swiglu = activation == FfnActivation::kSwiglu;
    const bool vec = ffn % kWordElems == 0 && aligned16(h) && aligned16(a);
    const int64_t items = vec ? rows * (ffn / kWordElems) : rows * ffn;
    const int blocks = grid_blocks(num_sms, ceil_div<int64_t>(items, kThreads), kBlocksPerSm);
    if (vec && swiglu) {
        activate_rows_vec_kernel<true><<<blocks, kThreads, 0, stream>>>(h, a, rows, ffn, end, zero_past_end);
    } else if (vec) {
        activate_rows_vec_kernel<false><<<blocks, kThreads, 0, stream>>>(h, a, rows, ffn, end, zero_past_end);
    } else if (swiglu) {
        activate_rows_scalar_kernel<true><<<blocks, kThreads, 0, stream>>>(h, a, rows, ffn, end, zero_past_end);
    } else {
        activate_rows_scalar_kernel<false><<<blocks, kThreads, 0, stream>>>(h, a, rows, ffn, end, zero_past_end);
    }
    FLATEP_CUDA_CHECK_LAUNCH();
}

void launch_zero_rows_from_end(uint16_t* y, int64_t rows, int64_t cols, const int32_t* end, cudaStream_t stream,
                               int num_sms) {
    if (rows == 0) return;
    const bool vec = cols % kWordElems == 0 && aligned16(y);
    const int64_t per_row = vec ? cols / kWordElems : cols;
    const int blocks = grid_blocks(num_sms, ceil_div<int64_t>(rows * per_row, kThreads), kBlocksPerSm);
    if (vec) {
        zero_rows_from_end_kernel<true><<<blocks, kThreads, 0, stream>>>(y, rows, per_row, end);
    } else {
        zero_rows_from_end_kernel<false><<<blocks, kThreads, 0, stream>>>(y, rows, per_row, end);
    }
    FLATEP_CUDA_CHECK_LAUNCH();
}

FLATEP_PRELOAD_KERNELS(activate_rows_vec_kernel<true>, activate_rows_vec_kernel<false>,
                       activate_rows_scalar_kernel<true>, activate_rows_scalar_kernel<false>,
                       zero_rows_from_end_kernel<true>, zero_rows_from_end_kernel<false>);

}  // namespace flatep::kernels
