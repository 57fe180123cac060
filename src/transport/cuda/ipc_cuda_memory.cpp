#include "transport/cuda/ipc_cuda_memory.hpp"

#include <unistd.h>

#include <cstdint>

#include "common/check.hpp"
#include "common/log.hpp"
#include "transport/cuda/cu_driver.hpp"

namespace flatep {

namespace {

// Teardown variant: logs instead of throwing.
void cu_log(const CuDriver& driver, CUresult result, const char* what) noexcept {
    if (result == CUDA_SUCCESS) return;
    try {
        FLATEP_LOG_WARN(cu_error_text(driver, result, what));
    } catch (...) {
    }
}

class CudaIpcMemory final : public IpcMemory {
  public:
    CudaIpcMemory() {
        std::string why;
        drv_ = cu_driver(&why);
        FLATEP_CHECK_RUNTIME(drv_ != nullptr, "ipc transport: device memory needs the CUDA driver: ", why);
        FLATEP_CU_DRIVER_CHECK(*drv_, cuInit(0));
        CUcontext context = nullptr;
        FLATEP_CU_DRIVER_CHECK(*drv_, cuCtxGetCurrent(&context));
        if (context == nullptr) {
            FLATEP_CU_DRIVER_CHECK(*drv_, cuDeviceGet(&device_, 0));
            FLATEP_CU_DRIVER_CHECK(*drv_, cuDevicePrimaryCtxRetain(&context, device_));
            retained_ = true;
            FLATEP_CU_DRIVER_CHECK(*drv_, cuCtxSetCurrent(context));
        }
        FLATEP_CU_DRIVER_CHECK(*drv_, cuCtxGetDevice(&device_));
        int vmm = 0, posix_fd = 0;
        FLATEP_CU_DRIVER_CHECK(
            *drv_, cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_));
        FLATEP_CU_DRIVER_CHECK(
            *drv_,
            cuDeviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device_));
        FLATEP_CHECK_RUNTIME(vmm != 0 && posix_fd != 0, "ipc transport: device ", device_,
                             " does not support VMM allocations exported as POSIX file descriptors (vmm ", vmm,
                             ", posix fd ", posix_fd, ")");
        prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop_.location.id = device_;
        prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        FLATEP_CU_DRIVER_CHECK(
            *drv_, cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    }

    ~CudaIpcMemory() override {
        if (retained_) cu_log(*drv_, drv_->cuDevicePrimaryCtxRelease(device_), "cuDevicePrimaryCtxRelease");
    }

    MemoryKind kind() const override { return MemoryKind::kDevice; }
    size_t granularity() const override { return granularity_; }

    IpcLocalMemory create(size_t mapped_bytes) override {
        CUmemGenericAllocationHandle handle = 0;
        FLATEP_CU_DRIVER_CHECK(*drv_, cuMemCreate(&handle, mapped_bytes, &prop_, 0));
        IpcLocalMemory local;
        local.handle = handle;
        local.mapped_bytes = mapped_bytes;
        try {
            local.ptr = map_handle(handle, mapped_bytes);
            // Zero before the descriptor leaves this process: a peer can only map it after the exchange.
            FLATEP_CU_DRIVER_CHECK(*drv_, cuMemsetD8(reinterpret_cast<CUdeviceptr>(local.ptr), 0, mapped_bytes));
            FLATEP_CU_DRIVER_CHECK(*drv_, cuCtxSynchronize());
            int fd = -1;
            FLATEP_CU_DRIVER_CHECK(
                *drv_, cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
            local.fd = fd;
        } catch (...) {
            destroy(local);
            throw;
        }
        return local;
    }

    uint8_t* map_peer(int fd, size_t mapped_bytes) override {
        CUmemGenericAllocationHandle handle = 0;
        FLATEP_CU_DRIVER_CHECK(
            *drv_, cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        uint8_t* ptr = nullptr;
        try {
            ptr = map_handle(handle, mapped_bytes);
        } catch (...) {
            cu_log(*drv_, drv_->cuMemRelease(handle), "cuMemRelease(imported handle)");
            throw;
        }
        // The mapping holds its own reference to the peer's physical memory.
        cu_log(*drv_, drv_->cuMemRelease(handle), "cuMemRelease(imported handle)");
        return ptr;
    }

    void unmap_peer(uint8_t* ptr, size_t mapped_bytes) noexcept override {
        if (ptr == nullptr) return;
        cu_log(*drv_, drv_->cuCtxSynchronize(), "cuCtxSynchronize before unmapping a peer region");
        unmap(ptr, mapped_bytes);
    }

    void destroy(IpcLocalMemory& local) noexcept override {
        if (local.ptr != nullptr) {
            cu_log(*drv_, drv_->cuCtxSynchronize(), "cuCtxSynchronize before freeing a region");
            unmap(local.ptr, local.mapped_bytes);
        }
        if (local.handle != 0) cu_log(*drv_, drv_->cuMemRelease(local.handle), "cuMemRelease");
        if (local.fd >= 0 && ::close(local.fd) != 0) FLATEP_LOG_WARN("close(exported CUDA fd) failed");
        local = IpcLocalMemory{};
    }

  private:
    uint8_t* map_handle(CUmemGenericAllocationHandle handle, size_t mapped_bytes) {
        CUdeviceptr ptr = 0;
        FLATEP_CU_DRIVER_CHECK(*drv_, cuMemAddressReserve(&ptr, mapped_bytes, granularity_, 0, 0));
        CUresult result = drv_->cuMemMap(ptr, mapped_bytes, 0, handle, 0);
        if (result != CUDA_SUCCESS) {
            cu_log(*drv_, drv_->cuMemAddressFree(ptr, mapped_bytes), "cuMemAddressFree");
            FLATEP_THROW(ErrorCategory::kRuntime, cu_error_text(*drv_, result, "cuMemMap/cuMemSetAccess"));
        }
        CUmemAccessDesc access{};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = device_;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        result = drv_->cuMemSetAccess(ptr, mapped_bytes, &access, 1);
        if (result != CUDA_SUCCESS) {
            unmap(reinterpret_cast<uint8_t*>(ptr), mapped_bytes);
            FLATEP_THROW(ErrorCategory::kRuntime, cu_error_text(*drv_, result, "cuMemMap/cuMemSetAccess"));
        }
        return reinterpret_cast<uint8_t*>(ptr);
    }

    void unmap(uint8_t* ptr, size_t mapped_bytes) noexcept {
        const CUdeviceptr address = reinterpret_cast<CUdeviceptr>(ptr);
        cu_log(*drv_, drv_->cuMemUnmap(address, mapped_bytes), "cuMemUnmap");
        cu_log(*drv_, drv_->cuMemAddressFree(address, mapped_bytes), "cuMemAddressFree");
    }

    const CuDriver* drv_ = nullptr;
    CUdevice device_ = 0;
    bool retained_ = false;
    size_t granularity_ = 0;
    CUmemAllocationProp prop_{};
};

}  // namespace

std::unique_ptr<IpcMemory> make_cuda_ipc_memory() { return std::make_unique<CudaIpcMemory>(); }

}  // namespace flatep
