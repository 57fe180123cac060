// Launch helpers shared by every op's launcher: the one-block barrier kernel, grid sizing under the SM budget, the
// kernels library's scratch buffers, and preloading every kernel (see preload_all_kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/macros.hpp"
#include "common/math.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/preload.hpp"
#include "sync/barrier.cuh"
#include "sync/sync.hpp"

namespace flatep::kernels {

// A kernel-parameter copy of one of an Args' per-rank pointer arrays (symmetric buffer bases, slot pools, reduce
// pools): every rank's pointer as mapped in this process.
template <class T>
struct PerRank {
    T* ptr[kMaxRanks];
};
using PeerPointers = PerRank<uint8_t>;  // every rank's symmetric buffer base

// Host: the copy of ptrs[0, num_ranks); the rest null. num_ranks must be in [1, kMaxRanks] (kInvalidArgument
// naming `op` otherwise).
template <class T>
PerRank<T> per_rank(const char* op, T* const* ptrs, int num_ranks) {
    FLATEP_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, op, ": num_ranks out of range: ", num_ranks);
    PerRank<T> out{};
    for (int r = 0; r < num_ranks; ++r) out.ptr[r] = ptrs[r];
    return out;
}

// Host: loads the given kernels now (cudaFuncGetAttributes loads a kernel's module); FLATEP_PRELOAD_KERNELS calls it.
template <class... Kernels>
void preload_kernels(Kernels... kernels) {
    const void* const list[] = {reinterpret_cast<const void*>(kernels)...};
    cudaFuncAttributes attr{};
    for (const void* kernel : list) FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
}

// Host: adds `preload` to the functions preload_all_kernels (kernels/common/preload.hpp) calls; returns true. Only
// FLATEP_PRELOAD_KERNELS calls it.
bool register_preload(void (*preload)());

// Host: a one-block kernel running block_barrier on `stream` (between two kernels of an op).
void launch_barrier(const sync::SyncArgs& sync, int op, cudaStream_t stream);

// Host: multiprocessors of the current device (cached per device).
int device_sm_count();

// Host: blocks for a launch of `work_blocks` blocks of work under the op's SM budget `num_sms` (the most thread blocks
// one launch uses; 0: blocks_per_sm blocks on every multiprocessor); at least 1 (grid_blocks_for of grid.hpp on the
// current device). Every launcher takes num_sms as an argument of its launch (never from its Args): the one way the
// budget travels.
int grid_blocks(int num_sms, int64_t work_blocks, int blocks_per_sm);

// Host: blocks for a kernel that gives each of a call's tokens a warp, or row_slices warps when the grid has more
// warps than the call has tokens: warps for the layout's S tokens and at least one block a multiprocessor (four
// blocks an SM at most), under the budget num_sms. Without the floor a layout sized for decode (S = 128: 8 blocks of
// 16 warps) left each token's row to one warp. token_blocks_for of grid.hpp on the current device.
int token_blocks(int num_sms, int layout_tokens, int warps_per_block);

// Host: a device scratch buffer of at least `bytes`, owned by the kernels library, one per (key, device); grows
// on demand. Must first be called outside stream capture (allocation is not capturable); throws if it would need
// to grow while `stream` is capturing.
void* scratch_buffer(int key, size_t bytes, cudaStream_t stream);

}  // namespace flatep::kernels

// FLATEP_PRELOAD_KERNELS(kernel, ...): one line at namespace scope of every .cu of src/kernels, after its kernels,
// naming each kernel (each template instance) the file launches: preload_all_kernels then loads them, with no list
// kept by hand. Registering from a static initialiser is safe:
//  * the registry is a function-local static of launch.cu, built on its first use, so a registration finds it
//    constructed whatever order the files' static initialisers run in;
//  * registering only stores a function pointer (no CUDA call before main or while a library loads); the kernels are
//    loaded later, when preload_all_kernels runs inside a context (the runtime's device backend, LocalDeviceGroup);
//  * the kernels library is static, so a binary holds a .cu's object (and its registration) only when it references
//    it; every binary that launches one of the file's kernels does, through the file's launcher, and a file that is
//    not linked in has no kernel that could be launched.
// One use per file (a second is a redefinition); tests/gpu/preload_registry_main.cpp checks that every file
// registered.
#define FLATEP_PRELOAD_KERNELS(...)                                                                   \
    namespace {                                                                                       \
    [[maybe_unused]] const bool preload_registered =                                                  \
        ::flatep::kernels::register_preload([] { ::flatep::kernels::preload_kernels(__VA_ARGS__); }); \
    }                                                                                                 \
    static_assert(true, "FLATEP_PRELOAD_KERNELS ends with a semicolon")
