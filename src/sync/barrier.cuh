// Device side of the cross-rank barrier of sync/sync.hpp (one block of a rank meets every peer). The launch helpers
// built on it (launch_barrier, grid_blocks, preload_all_kernels) are the kernels' own: kernels/common/launch.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/macros.hpp"
#include "sync/ptx.cuh"
#include "sync/sync.hpp"
#include "sync/timed_wait.cuh"

namespace flatep::sync::device {

// Full barrier of all sync.num_ranks ranks, run by every thread of ONE block of this rank (num_threads >= number
// of ranks). Protocol (sync.hpp): e = ++*epoch (the epoch lives in device memory, so graph replays continue the
// sequence); thread p store-releases flag_word(e, op, sync.step) into flags[p][rank]; thread p waits until
// flags[rank][p] reaches e in the same (op, step). Ordering contract: every write made before the call by any thread
// of this block, or by any earlier kernel in this rank's stream, is visible to every thread of every peer after that
// peer's barrier returns (the __syncthreads + fence.acq_rel.sys before each release store make the release cover the
// whole block's writes and what the block has observed). Returns false (same value in every thread) when a wait
// failed (timeout, mismatch, or a peer's abort); this rank then stores its word with kFlagAbortBit into its slot of
// every peer's flags, so that every peer fails at its next wait on this rank instead of running on with stale flags.
FLATEP_DEVICE bool block_barrier(const SyncArgs& sync, int op, int thread_idx) {
    __shared__ uint64_t epoch_s;
    __shared__ int failed_s, already_failed_s;
    __syncthreads();
    if (thread_idx == 0) {
        const uint64_t e = *sync.epoch + 1;
        *sync.epoch = e;
        epoch_s = e;
        already_failed_s = wait_already_failed(sync) ? 1 : 0;  // a rank that failed before never publishes again
        failed_s = already_failed_s;
    }
    __syncthreads();
    const uint64_t mine = flag_word(epoch_s, op, sync.step);
    if (thread_idx < sync.num_ranks && failed_s == 0) {
        fence_acq_rel_sys();
        st_release_sys(&sync.flags[thread_idx][sync.rank], mine);
        if (thread_idx != sync.rank &&
            !wait_flag_at_least(sync, op, thread_idx, &sync.flags[sync.rank][thread_idx], mine)) {
            failed_s = 1;
        }
    }
    __syncthreads();
    const bool failed = failed_s != 0;
    // Abort: a release store like any flag word (nothing written before it needs to be seen: the step is lost); a
    // rank that failed before keeps the abort word of its first failure.
    if (failed && thread_idx < sync.num_ranks && !already_failed_s) {
        st_release_sys(&sync.flags[thread_idx][sync.rank], mine | kFlagAbortBit);
    }
    return !failed;
}

}  // namespace flatep::sync::device
