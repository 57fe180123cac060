#include "common/check.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/groups.cuh"
#include "kernels/common/launch.cuh"
#include "ops/entry_values_args.hpp"

namespace flatep::kernels {

namespace {

constexpr int kThreads = 256;

// Destination side: thread per row; only real rows are published (padding rows carry nothing).
__global__ void __launch_bounds__(kThreads)
    entry_values_publish_kernel(Layout l, int rank, PlanView p, const float* row_values, float* sym_w) {
    const int32_t end = rows_end(l, p, rank);
    for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < end; r += int64_t(gridDim.x) * blockDim.x) {
        if (classify_row(l, p, rank, r) == kRowReal) sym_w[r] = row_values[r];
    }
}

// Source side: thread per entry; one 4-byte remote read each.
__global__ void __launch_bounds__(kThreads)
    entry_values_pull_kernel(Layout l, PlanView p, SymmetricLayout sym, PeerPointers peers, float* out) {
    const int64_t num_entries = int64_t(plan_num_tokens(p)) * l.topk;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < num_entries;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int d = p.entry_rank[i];
        out[i] = d < 0 ? 0.0f : region_at<const float>(peers.ptr[d], sym.recv_w_offset)[p.entry_row[i]];
    }
}

}  // namespace

void launch(const EntryValuesArgs& a, cudaStream_t stream, int num_sms) {
    const Layout& l = a.layout;
    const SymmetricLayout sym = make_symmetric_layout(l);
    const PeerPointers peers = per_rank("entry_values", a.peers, l.num_ranks);
    launch_barrier(a.sync, sync::kOpEntryValues, stream);  // sources of the previous op are done with recv_w
    const int publish_blocks = grid_blocks(num_sms, ceil_div(l.num_recv_rows, kThreads), 4);
    entry_values_publish_kernel<<<publish_blocks, kThreads, 0, stream>>>(
        l, a.rank, a.plan, a.row_values, region_at<float>(a.peers[a.rank], sym.recv_w_offset));
    FLATEP_CUDA_CHECK_LAUNCH();
    launch_barrier(a.sync, sync::kOpEntryValues, stream);  // every destination's values are published
    const int pull_blocks = grid_blocks(num_sms, ceil_div(l.num_entries(), kThreads), 4);
    entry_values_pull_kernel<<<pull_blocks, kThreads, 0, stream>>>(l, a.plan, sym, peers, a.out);
    FLATEP_CUDA_CHECK_LAUNCH();
}

}  // namespace flatep::kernels

namespace flatep::kernels {

FLATEP_PRELOAD_KERNELS(entry_values_publish_kernel, entry_values_pull_kernel);

}  // namespace flatep::kernels
