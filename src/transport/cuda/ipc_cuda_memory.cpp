#include "transport/cuda/ipc_cuda_memory.hpp"

#include <unistd.h>

#include <cstdint>
#include <memory>

#include "common/check.hpp"
#include "common/log.hpp"
#include "transport/cuda/cu_driver.hpp"

namespace flatep::transport {

namespace {

// Teardown variant: logs instead of throwing.
void cu_log(const CuDriver& driver, CUresult result, const char* what) noexcept {
    if (result == CUDA_SUCCESS) return;
    try {
        FLATEP_LOG_WARN(cu_error_text(driver, result, what));
    } catch (...) {
    }
}

// Makes `context` current on the calling thread for the scope's lifetime when another one (or none) is, and puts the
// previous one back at its end: the transport's driver calls run in its own context on any thread (a rank's thread,
// Python's garbage collector, the interpreter's exit) without changing what the caller has current.
class ContextScope final : public DeviceBinding {
  public:
    ContextScope(const CuDriver& driver, CUcontext context) noexcept : driver_(driver) {
        result_ = driver_.cuCtxGetCurrent(&saved_);
        if (result_ == CUDA_SUCCESS && saved_ != context) {
            result_ = driver_.cuCtxSetCurrent(context);
            switched_ = result_ == CUDA_SUCCESS;
        }
    }
    ~ContextScope() override {
        if (switched_) cu_log(driver_, driver_.cuCtxSetCurrent(saved_), "cuCtxSetCurrent (restoring the caller's)");
    }
    ContextScope(const ContextScope&) = delete;
    ContextScope& operator=(const ContextScope&) = delete;

    // For calls that may throw: throws naming the failed binding.
    void check() const {
        if (result_ != CUDA_SUCCESS)
            FLATEP_THROW(ErrorCategory::kRuntime,
                         cu_error_text(driver_, result_, "binding the transport's CUDA context"));
    }
    // For teardown: logs a failed binding; true when bound.
    bool bound(const char* what) const noexcept {
        if (result_ == CUDA_SUCCESS) return true;
        cu_log(driver_, result_, what);
        return false;
    }

  private:
    const CuDriver& driver_;
    CUcontext saved_ = nullptr;
    CUresult result_ = CUDA_SUCCESS;
    bool switched_ = false;
};

class CudaIpcMemory final : public IpcMemory {
  public:
    explicit CudaIpcMemory(int ordinal) {
        std::string why;
        drv_ = cu_driver(&why);
        FLATEP_CHECK_RUNTIME(drv_ != nullptr, "ipc transport: device memory needs the CUDA driver: ", why);
        FLATEP_CU_DRIVER_CHECK(*drv_, cuInit(0));
        if (ordinal < 0) {  // the calling thread's current context's device, else device 0
            CUcontext current = nullptr;
            FLATEP_CU_DRIVER_CHECK(*drv_, cuCtxGetCurrent(&current));
            CUdevice current_device = 0;
            if (current != nullptr) FLATEP_CU_DRIVER_CHECK(*drv_, cuCtxGetDevice(&current_device));
            ordinal = static_cast<int>(current_device);
        }
        int count = 0;
        FLATEP_CU_DRIVER_CHECK(*drv_, cuDeviceGetCount(&count));
        FLATEP_CHECK(ordinal < count, "ipc transport: device must be in [0, ", count, ") (the CUDA devices here), got ",
                     ordinal);
        ordinal_ = ordinal;
        FLATEP_CU_DRIVER_CHECK(*drv_, cuDeviceGet(&device_, ordinal));
        // The device's primary context (torch's): retained for the transport's lifetime, so it outlives the runtime's
        // own teardown at exit while regions are still to be freed.
        FLATEP_CU_DRIVER_CHECK(*drv_, cuDevicePrimaryCtxRetain(&context_, device_));
        try {
            int vmm = 0, posix_fd = 0;
            FLATEP_CU_DRIVER_CHECK(
                *drv_, cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_));
            FLATEP_CU_DRIVER_CHECK(
                *drv_, cuDeviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                            device_));
            FLATEP_CHECK_RUNTIME(vmm != 0 && posix_fd != 0, "ipc transport: device ", ordinal_,
                                 " does not support VMM allocations exported as POSIX file descriptors (vmm ", vmm,
                                 ", posix fd ", posix_fd, ")");
            prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
            prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prop_.location.id = device_;
            prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            FLATEP_CU_DRIVER_CHECK(
                *drv_, cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
        } catch (...) {
            cu_log(*drv_, drv_->cuDevicePrimaryCtxRelease(device_), "cuDevicePrimaryCtxRelease");
            throw;
        }
    }

    ~CudaIpcMemory() override { cu_log(*drv_, drv_->cuDevicePrimaryCtxRelease(device_), "cuDevicePrimaryCtxRelease"); }

    MemoryKind kind() const override { return MemoryKind::kDevice; }
    int device() const override { return ordinal_; }

    std::unique_ptr<DeviceBinding> bind_device() override {
        auto scope = std::make_unique<ContextScope>(*drv_, context_);
        scope->check();
        return scope;
    }
    size_t granularity() const override { return granularity_; }

    IpcMapping create(size_t mapped_bytes, bool exported) override {
        const ContextScope scope(*drv_, context_);
        scope.check();
        CUmemGenericAllocationHandle handle = 0;
        FLATEP_CU_DRIVER_CHECK(*drv_, cuMemCreate(&handle, mapped_bytes, &prop_, 0));
        IpcMapping local;
        local.handle = handle;
        local.mapped_bytes = mapped_bytes;
        try {
            local.ptr = reserve(mapped_bytes);
            try {
                map_at(local.ptr, local);
            } catch (...) {
                cu_log(*drv_, drv_->cuMemAddressFree(address(local.ptr), mapped_bytes), "cuMemAddressFree");
                local.ptr = nullptr;
                throw;
            }
            // Zero before the descriptor leaves this process: a peer can only map it after the exchange.
            FLATEP_CU_DRIVER_CHECK(*drv_, cuMemsetD8(address(local.ptr), 0, mapped_bytes));
            FLATEP_CU_DRIVER_CHECK(*drv_, cuCtxSynchronize());
            if (exported) {
                int fd = -1;
                FLATEP_CU_DRIVER_CHECK(
                    *drv_, cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
                local.fd = fd;
            }
        } catch (...) {
            destroy(local);
            throw;
        }
        return local;
    }

    IpcMapping map_peer(int fd, size_t mapped_bytes) override {
        const ContextScope scope(*drv_, context_);
        scope.check();
        CUmemGenericAllocationHandle handle = 0;
        FLATEP_CU_DRIVER_CHECK(
            *drv_, cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        IpcMapping peer;
        peer.handle = handle;  // kept until unmap_peer: views map the peer's memory again from it
        peer.mapped_bytes = mapped_bytes;
        try {
            peer.ptr = reserve(mapped_bytes);
            try {
                map_at(peer.ptr, peer);
            } catch (...) {
                cu_log(*drv_, drv_->cuMemAddressFree(address(peer.ptr), mapped_bytes), "cuMemAddressFree");
                throw;
            }
        } catch (...) {
            cu_log(*drv_, drv_->cuMemRelease(handle), "cuMemRelease(imported handle)");
            throw;
        }
        return peer;
    }

    void unmap_peer(IpcMapping& peer) noexcept override {
        const ContextScope scope(*drv_, context_);
        if (!scope.bound("binding the transport's CUDA context to unmap a peer region")) return;
        if (peer.ptr != nullptr) {
            cu_log(*drv_, drv_->cuCtxSynchronize(), "cuCtxSynchronize before unmapping a peer region");
            unmap(peer.ptr, peer.mapped_bytes);
        }
        if (peer.handle != 0) cu_log(*drv_, drv_->cuMemRelease(peer.handle), "cuMemRelease(imported handle)");
        peer = IpcMapping{};
    }

    void destroy(IpcMapping& local) noexcept override {
        const ContextScope scope(*drv_, context_);
        if (!scope.bound("binding the transport's CUDA context to free a region")) return;
        if (local.ptr != nullptr) {
            cu_log(*drv_, drv_->cuCtxSynchronize(), "cuCtxSynchronize before freeing a region");
            unmap(local.ptr, local.mapped_bytes);
        }
        if (local.handle != 0) cu_log(*drv_, drv_->cuMemRelease(local.handle), "cuMemRelease");
        if (local.fd >= 0 && ::close(local.fd) != 0) FLATEP_LOG_WARN("close(exported CUDA fd) failed");
        local = IpcMapping{};
    }

    uint8_t* reserve(size_t bytes) override {
        const ContextScope scope(*drv_, context_);
        scope.check();
        CUdeviceptr ptr = 0;
        FLATEP_CU_DRIVER_CHECK(*drv_, cuMemAddressReserve(&ptr, bytes, granularity_, 0, 0));
        return reinterpret_cast<uint8_t*>(ptr);
    }

    void map_at(uint8_t* at, const IpcMapping& memory) override {
        const ContextScope scope(*drv_, context_);
        scope.check();
        FLATEP_CHECK_RUNTIME(memory.handle != 0, "device memory view: the memory has no CUDA allocation handle");
        FLATEP_CU_DRIVER_CHECK(*drv_, cuMemMap(address(at), memory.mapped_bytes, 0, memory.handle, 0));
        CUmemAccessDesc access{};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = device_;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        const CUresult result = drv_->cuMemSetAccess(address(at), memory.mapped_bytes, &access, 1);
        if (result != CUDA_SUCCESS) {
            cu_log(*drv_, drv_->cuMemUnmap(address(at), memory.mapped_bytes), "cuMemUnmap");
            FLATEP_THROW(ErrorCategory::kRuntime, cu_error_text(*drv_, result, "cuMemSetAccess"));
        }
    }

    void free_range(uint8_t* base, size_t bytes,
                    const std::vector<std::pair<size_t, size_t>>& mapped) noexcept override {
        const ContextScope scope(*drv_, context_);
        if (!scope.bound("binding the transport's CUDA context to unmap a view")) return;
        if (!mapped.empty()) cu_log(*drv_, drv_->cuCtxSynchronize(), "cuCtxSynchronize before unmapping a view");
        for (const auto& [offset, piece_bytes] : mapped)
            cu_log(*drv_, drv_->cuMemUnmap(address(base + offset), piece_bytes), "cuMemUnmap");
        cu_log(*drv_, drv_->cuMemAddressFree(address(base), bytes), "cuMemAddressFree");
    }

  private:
    static CUdeviceptr address(const uint8_t* ptr) { return reinterpret_cast<CUdeviceptr>(ptr); }

    // One whole mapping made by create / map_peer: unmap, then free its range.
    void unmap(uint8_t* ptr, size_t mapped_bytes) noexcept {
        cu_log(*drv_, drv_->cuMemUnmap(address(ptr), mapped_bytes), "cuMemUnmap");
        cu_log(*drv_, drv_->cuMemAddressFree(address(ptr), mapped_bytes), "cuMemAddressFree");
    }

    const CuDriver* drv_ = nullptr;
    int ordinal_ = 0;
    CUdevice device_ = 0;
    CUcontext context_ = nullptr;  // device_'s primary context, retained
    size_t granularity_ = 0;
    CUmemAllocationProp prop_{};
};

}  // namespace

std::unique_ptr<IpcMemory> make_cuda_ipc_memory(int device) { return std::make_unique<CudaIpcMemory>(device); }

}  // namespace flatep::transport
