// Device side of the cross-rank barrier of transport/sync.hpp, and the launch helpers shared by every op.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "kernels/common/ptx.cuh"
#include "kernels/common/timed_wait.cuh"
#include "transport/sync.hpp"

namespace flatep::kernels {

// Every rank's symmetric buffer base as mapped in this process (kernel-parameter copy of an Args' peers array).
struct PeerPointers {
    uint8_t* ptr[kMaxRanks];
};

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

// Host: loads every kernel of the library on the current device now. CUDA's lazy module loading may otherwise load
// a kernel at its first launch and wait for running kernels while doing so, which deadlocks (until the timeout)
// when a running kernel spins on a peer whose kernel is the one being loaded. LocalDeviceGroup calls it.
void preload_all_kernels();
void preload_barrier_kernels();
void preload_plan_kernels();
void preload_dispatch_kernels();
void preload_combine_kernels();
void preload_prefetch_kernels();
void preload_grad_reduce_kernels();
void preload_entry_values_kernels();
void preload_combine_grad_kernels();
void preload_write_grads_kernels();

// Host: a one-block kernel running block_barrier on `stream` (between two kernels of an op).
void launch_barrier(const SyncArgs& sync, int op, cudaStream_t stream);

// Host: multiprocessors of the current device (cached per device).
int device_sm_count();

// Host: blocks for a launch of `work_blocks` blocks of work under this rank's SM budget (sync.max_blocks, or
// blocks_per_sm blocks on every multiprocessor when there is no budget); at least 1.
int grid_blocks(const SyncArgs& sync, int64_t work_blocks, int blocks_per_sm);
// The same for a local op (no SyncArgs): max_blocks is the SM budget (0: none).
int grid_blocks(int max_blocks, int64_t work_blocks, int blocks_per_sm);

// Host: a device scratch buffer of at least `bytes`, owned by the kernels library, one per (key, device); grows
// on demand. Must first be called outside stream capture (allocation is not capturable); throws if it would need
// to grow while `stream` is capturing.
void* scratch_buffer(int key, size_t bytes, cudaStream_t stream);

}  // namespace flatep::kernels
