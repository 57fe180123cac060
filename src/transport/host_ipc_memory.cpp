// The host-memory IpcMemory: memfds mapped with mmap. A peer's memory is kept as a dup of the fd it sent, so that a
// view can map it again after the exchange closed the received descriptor.
#include <sys/stat.h>

#include "common/check.hpp"
#include "transport/host_memory.hpp"
#include "transport/ipc_memory.hpp"

namespace flatep::transport {

namespace {

class HostIpcMemory final : public IpcMemory {
  public:
    MemoryKind kind() const override { return MemoryKind::kHost; }
    int device() const override { return -1; }
    std::unique_ptr<DeviceBinding> bind_device() override { return nullptr; }
    size_t granularity() const override { return host_memory::page_size(); }

    IpcMapping create(size_t mapped_bytes, bool /*exported: the memfd is always there*/) override {
        IpcMapping local;
        local.fd = host_memory::create(mapped_bytes, "flatep-ipc");
        try {
            local.ptr = static_cast<uint8_t*>(host_memory::map(local.fd, mapped_bytes));
        } catch (...) {
            host_memory::close_fd(local.fd);
            throw;
        }
        local.mapped_bytes = mapped_bytes;
        return local;
    }

    IpcMapping map_peer(int fd, size_t mapped_bytes) override {
        struct stat info {};
        FLATEP_SYS_CHECK(::fstat(fd, &info) == 0, "fstat(peer memfd)");
        // A shorter file would turn accesses past its end into SIGBUS.
        FLATEP_CHECK_RUNTIME(static_cast<size_t>(info.st_size) >= mapped_bytes, "ipc: a peer's memfd holds ",
                             info.st_size, " bytes, expected ", mapped_bytes);
        IpcMapping peer;
        peer.fd = host_memory::dup_fd(fd);
        try {
            peer.ptr = static_cast<uint8_t*>(host_memory::map(fd, mapped_bytes));
        } catch (...) {
            host_memory::close_fd(peer.fd);
            throw;
        }
        peer.mapped_bytes = mapped_bytes;
        return peer;
    }

    void unmap_peer(IpcMapping& peer) noexcept override { destroy(peer); }

    void destroy(IpcMapping& local) noexcept override {
        host_memory::unmap(local.ptr, local.mapped_bytes);
        host_memory::close_fd(local.fd);
        local = IpcMapping{};
    }

    uint8_t* reserve(size_t bytes) override { return static_cast<uint8_t*>(host_memory::reserve(bytes)); }

    void map_at(uint8_t* address, const IpcMapping& memory) override {
        FLATEP_CHECK_RUNTIME(memory.fd >= 0, "host memory view: the memory has no memfd to map");
        host_memory::map_fixed(address, memory.fd, memory.mapped_bytes, 0);
    }

    void free_range(uint8_t* base, size_t bytes, const std::vector<std::pair<size_t, size_t>>&) noexcept override {
        host_memory::unmap(base, bytes);  // the pieces and the PROT_NONE gaps in one call
    }
};

}  // namespace

std::unique_ptr<IpcMemory> make_host_ipc_memory() { return std::make_unique<HostIpcMemory>(); }

}  // namespace flatep::transport
