#include <mutex>
#include <vector>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/grid.hpp"
#include "kernels/common/launch.cuh"

namespace flatep::kernels {

namespace {

__global__ void barrier_kernel(sync::SyncArgs sync, int op) { sync::device::block_barrier(sync, op, threadIdx.x); }

// The preload functions of the kernel files linked into this binary, one per file (FLATEP_PRELOAD_KERNELS in
// launch.cuh: why registering from static initialisers is safe). Filled before main (or while the library loads),
// only read afterwards.
std::vector<void (*)()>& preloads() {
    static std::vector<void (*)()> registered;
    return registered;
}

}  // namespace

FLATEP_PRELOAD_KERNELS(barrier_kernel);

bool register_preload(void (*preload)()) {
    preloads().push_back(preload);
    return true;
}

int registered_preloads() { return int(preloads().size()); }

void preload_all_kernels() {
    for (void (*preload)() : preloads()) preload();
}

void launch_barrier(const sync::SyncArgs& sync, int op, cudaStream_t stream) {
    if (sync.num_ranks <= 1) return;
    const int threads = sync.num_ranks <= 32 ? 32 : 64;
    barrier_kernel<<<1, threads, 0, stream>>>(sync, op);
    FLATEP_CUDA_CHECK_LAUNCH();
}

int device_sm_count() {
    static std::mutex mutex;
    static std::vector<int> counts;
    int device = 0;
    FLATEP_CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mutex);
    if (int(counts.size()) <= device) counts.resize(device + 1, 0);
    if (counts[device] == 0) {
        FLATEP_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
    }
    return counts[device];
}

int grid_blocks(int num_sms, int64_t work_blocks, int blocks_per_sm) {
    return grid_blocks_for(num_sms, work_blocks, blocks_per_sm, num_sms > 0 ? 0 : device_sm_count());
}

int token_blocks(int num_sms, int layout_tokens, int warps_per_block) {
    return token_blocks_for(num_sms, layout_tokens, warps_per_block, device_sm_count());
}

void* scratch_buffer(int key, size_t bytes, cudaStream_t stream) {
    struct Entry {
        int key, device;
        void* ptr;
        size_t bytes;
    };
    static std::mutex mutex;
    static std::vector<Entry> entries;  // freed at exit by the driver
    int device = 0;
    FLATEP_CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mutex);
    for (Entry& e : entries) {
        if (e.key != key || e.device != device) continue;
        if (e.bytes >= bytes) return e.ptr;
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        FLATEP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
        FLATEP_CHECK_RUNTIME(capture == cudaStreamCaptureStatusNone, "kernels scratch ", key, " must grow to ", bytes,
                             " bytes during stream capture: call the op once before capturing, or pass a "
                             "workspace");
        FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
        FLATEP_CUDA_CHECK(cudaFree(e.ptr));
        e.ptr = nullptr;
        FLATEP_CUDA_CHECK(cudaMalloc(&e.ptr, bytes));
        e.bytes = bytes;
        return e.ptr;
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FLATEP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    FLATEP_CHECK_RUNTIME(capture == cudaStreamCaptureStatusNone, "kernels scratch ", key, " of ", bytes,
                         " bytes requested during stream capture: call the op once before capturing, or pass a "
                         "workspace");
    Entry e{key, device, nullptr, bytes};
    FLATEP_CUDA_CHECK(cudaMalloc(&e.ptr, bytes));
    entries.push_back(e);
    return e.ptr;
}

}  // namespace flatep::kernels
