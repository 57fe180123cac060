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
#include "transport/cuda/cu_driver.hpp"
#endif

namespace flatep::device {

#if defined(FLATEP_WITH_CUDA)

namespace {

const CuDriver& driver() {
    std::string why;
    const CuDriver* drv = cu_driver(&why);
    FLATEP_CHECK_RUNTIME(drv != nullptr, "ExpertPools: device memory needs the CUDA driver: ", why);
    return *drv;
}

// Teardown variant: logs instead of throwing.
void cu_log(const CuDriver& drv, CUresult result, const char* what) noexcept {
    if (result == CUDA_SUCCESS) return;
    try {
        FLATEP_LOG_WARN(cu_error_text(drv, result, what));
    } catch (...) {
    }
}

// Unmaps [address, address + bytes) (one whole mapping) when mapped; never throws.
void unmap(const CuDriver& drv, uint8_t* address, size_t bytes) noexcept {
    if (address != nullptr && bytes != 0)
        cu_log(drv, drv.cuMemUnmap(reinterpret_cast<CUdeviceptr>(address), bytes), "cuMemUnmap");
}

void free_range(const CuDriver& drv, uint8_t* address, size_t bytes) noexcept {
    if (address != nullptr)
        cu_log(drv, drv.cuMemAddressFree(reinterpret_cast<CUdeviceptr>(address), bytes), "cuMemAddressFree");
}

// The current context's device and the allocation properties of a layer's memory (pinned device memory).
CUmemAllocationProp layer_prop(const CuDriver& drv) {
    CUdevice device = 0;
    const CUresult result = drv.cuCtxGetDevice(&device);
    FLATEP_CHECK_RUNTIME(result == CUDA_SUCCESS, "ExpertPools: no current CUDA context (",
                         cu_error_text(drv, result, "cuCtxGetDevice"), "); create the transport first");
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    return prop;
}

}  // namespace

LayerAllocation create_layer_allocation(size_t data_bytes, uint64_t pool_handle, size_t pool_bytes) {
    const CuDriver& drv = driver();
    FLATEP_CHECK_RUNTIME(pool_handle != 0, "ExpertPools: the pool region has no CUDA allocation handle");
    const CUmemAllocationProp prop = layer_prop(drv);
    size_t granularity = 0, minimum = 0;
    FLATEP_CU_DRIVER_CHECK(drv,
                           cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    FLATEP_CU_DRIVER_CHECK(drv, cuMemGetAllocationGranularity(&minimum, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    FLATEP_CHECK_RUNTIME(granularity > 0 && minimum > 0 && pool_bytes % minimum == 0, "ExpertPools: pool of ",
                         pool_bytes, " bytes is not a multiple of the allocation granularity ", minimum);

    LayerAllocation a;
    a.bytes = (data_bytes + granularity - 1) / granularity * granularity;
    a.view_bytes = a.bytes + pool_bytes;
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUdeviceptr own = 0, view = 0;
    bool own_mapped = false, view_own_mapped = false, view_pool_mapped = false;
    try {
        CUmemGenericAllocationHandle handle = 0;
        FLATEP_CU_DRIVER_CHECK(drv, cuMemCreate(&handle, a.bytes, &prop, 0));
        a.handle = handle;
        // The layer's memory alone.
        FLATEP_CU_DRIVER_CHECK(drv, cuMemAddressReserve(&own, a.bytes, granularity, 0, 0));
        FLATEP_CU_DRIVER_CHECK(drv, cuMemMap(own, a.bytes, 0, handle, 0));
        own_mapped = true;
        FLATEP_CU_DRIVER_CHECK(drv, cuMemSetAccess(own, a.bytes, &access, 1));
        // The compute view: the layer's memory, then the pool's right after it.
        FLATEP_CU_DRIVER_CHECK(drv, cuMemAddressReserve(&view, a.view_bytes, granularity, 0, 0));
        FLATEP_CU_DRIVER_CHECK(drv, cuMemMap(view, a.bytes, 0, handle, 0));
        view_own_mapped = true;
        FLATEP_CU_DRIVER_CHECK(drv, cuMemMap(view + a.bytes, pool_bytes, 0, pool_handle, 0));
        view_pool_mapped = true;
        FLATEP_CU_DRIVER_CHECK(drv, cuMemSetAccess(view, a.view_bytes, &access, 1));
        // Zero-fill (the legacy stream, then wait: the ops' streams do not wait for it).
        FLATEP_CU_DRIVER_CHECK(drv, cuMemsetD8(own, 0, a.bytes));
        FLATEP_CU_DRIVER_CHECK(drv, cuCtxSynchronize());
    } catch (...) {
        if (view_pool_mapped) unmap(drv, reinterpret_cast<uint8_t*>(view + a.bytes), pool_bytes);
        if (view_own_mapped) unmap(drv, reinterpret_cast<uint8_t*>(view), a.bytes);
        if (own_mapped) unmap(drv, reinterpret_cast<uint8_t*>(own), a.bytes);
        if (view != 0) free_range(drv, reinterpret_cast<uint8_t*>(view), a.view_bytes);
        if (own != 0) free_range(drv, reinterpret_cast<uint8_t*>(own), a.bytes);
        if (a.handle != 0) cu_log(drv, drv.cuMemRelease(a.handle), "cuMemRelease");
        throw;
    }
    a.own = reinterpret_cast<uint8_t*>(own);
    a.view = reinterpret_cast<uint8_t*>(view);
    return a;
}

void destroy_layer_allocation(LayerAllocation& a) noexcept {
    if (a.handle == 0 && a.own == nullptr && a.view == nullptr) return;
    const CuDriver* drv = cu_driver();
    if (drv == nullptr) return;  // cannot happen once an allocation exists
    cu_log(*drv, drv->cuCtxSynchronize(), "cuCtxSynchronize before freeing a layer's memory");
    if (a.view != nullptr) {
        unmap(*drv, a.view + a.bytes, a.view_bytes - a.bytes);
        unmap(*drv, a.view, a.bytes);
        free_range(*drv, a.view, a.view_bytes);
    }
    if (a.own != nullptr) {
        unmap(*drv, a.own, a.bytes);
        free_range(*drv, a.own, a.bytes);
    }
    if (a.handle != 0) cu_log(*drv, drv->cuMemRelease(a.handle), "cuMemRelease");
    a = LayerAllocation{};
}

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

LayerAllocation create_layer_allocation(size_t, uint64_t, size_t) { no_cuda(); }
void destroy_layer_allocation(LayerAllocation& allocation) noexcept { allocation = LayerAllocation{}; }
PoolsContext::PoolsContext() { no_cuda(); }
PoolsContext::~PoolsContext() = default;
void PoolsContext::fill_sync(sync::SyncArgs&) const { no_cuda(); }
void PoolsContext::prefetch(const PrefetchArgs&, void*) const { no_cuda(); }
void PoolsContext::grad_reduce(const GradReduceArgs&, void*) const { no_cuda(); }
void PoolsContext::write_grads(const WriteGradsArgs&, void*) const { no_cuda(); }

#endif

}  // namespace flatep::device
