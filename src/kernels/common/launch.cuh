// Launch helpers shared by every op's launcher: the one-block barrier kernel, grid sizing under the SM budget, the
// kernels library's scratch buffers, and preloading every kernel (see preload_all_kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "sync/barrier.cuh"
#include "sync/sync.hpp"

namespace flatep::kernels {

// Every rank's symmetric buffer base as mapped in this process (kernel-parameter copy of an Args' peers array).
struct PeerPointers {
    uint8_t* ptr[kMaxRanks];
};

// Host: loads every kernel of the library on the current device now. CUDA's lazy module loading may otherwise load
// a kernel at its first launch and wait for running kernels while doing so, which deadlocks (until the timeout)
// when a running kernel spins on a peer whose kernel is the one being loaded. The runtime and LocalDeviceGroup
// (src/testing) call it.
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
