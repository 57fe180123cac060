#include "runtime/device_pools.hpp"

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"

#if defined(FLATEP_WITH_CUDA)
#include <cuda_runtime.h>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/preload.hpp"
#include "kernels/grad_reduce/grad_reduce.cuh"
#include "kernels/prefetch/prefetch.cuh"
#include "kernels/write_grads/write_grads.cuh"
#endif

namespace flatep::device {

#if defined(FLATEP_WITH_CUDA)

PoolsContext::PoolsContext() {
    kernels::preload_all_kernels();  // no lazy module load while a peer's kernel spins (see kernels/common/preload.hpp)
    FLATEP_CUDA_CHECK(cudaMalloc(&epoch_, sync::kEpochWords * sizeof(uint64_t)));
    const cudaError_t zeroed = cudaMemset(epoch_, 0, sync::kEpochWords * sizeof(uint64_t));
    if (zeroed != cudaSuccess) {
        cudaFree(epoch_);
        FLATEP_THROW(ErrorCategory::kRuntime, "ExpertPools: cudaMemset(epoch) failed: ", cudaGetErrorName(zeroed));
    }
    max_blocks_ = env::sm_budget();
}

PoolsContext::~PoolsContext() {
    if (epoch_ != nullptr && cudaFree(epoch_) != cudaSuccess) FLATEP_LOG_WARN("ExpertPools: cudaFree(epoch) failed");
}

void PoolsContext::fill_sync(sync::SyncArgs& sync) const {
    sync.epoch = epoch_;
    sync.wait_record = wait_.device_pointer();
    sync.max_blocks = max_blocks_;
}

void PoolsContext::prefetch(const PrefetchArgs& args, void* stream) const {
    kernels::launch(args, static_cast<cudaStream_t>(stream));
}

void PoolsContext::grad_reduce(const GradReduceArgs& args, void* stream) const {
    kernels::launch(args, static_cast<cudaStream_t>(stream));
}

void PoolsContext::write_grads(const WriteGradsArgs& args, void* stream) const {
    kernels::launch(args, static_cast<cudaStream_t>(stream));
}

#else  // no CUDA in this build

namespace {
[[noreturn]] void no_cuda() {
    FLATEP_THROW(ErrorCategory::kRuntime, "this FlatEP build has no CUDA support (nvcc was not found at build time)");
}
}  // namespace

PoolsContext::PoolsContext() { no_cuda(); }
PoolsContext::~PoolsContext() = default;
void PoolsContext::fill_sync(sync::SyncArgs&) const { no_cuda(); }
void PoolsContext::prefetch(const PrefetchArgs&, void*) const { no_cuda(); }
void PoolsContext::grad_reduce(const GradReduceArgs&, void*) const { no_cuda(); }
void PoolsContext::write_grads(const WriteGradsArgs&, void*) const { no_cuda(); }

#endif

}  // namespace flatep::device
