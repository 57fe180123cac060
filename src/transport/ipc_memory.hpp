// How a transport creates, exports, imports and maps memory of one kind: memfd + mmap on the host
// (host_ipc_memory.cpp), CUDA VMM with POSIX file-descriptor handles on the device (cuda/ipc_cuda_memory.cpp). The ipc
// transport builds its regions on it; every transport builds its local memory and views on it (memory_views.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "flatep/transport.hpp"

namespace flatep::transport {

// One allocation as mapped in this process, with what maps it again at another address.
struct IpcMapping {
    uint8_t* ptr = nullptr;   // mapped in this process
    size_t mapped_bytes = 0;  // a multiple of the granularity
    // Host: the memfd (for a peer's memory, this process's own dup of the peer's fd). Device: the descriptor exported
    // from the handle (create(..., true) only, until the transport closes it); -1 when none.
    int fd = -1;
    uint64_t handle = 0;  // device: CUmemGenericAllocationHandle (created here, or imported from a peer); 0 on the host
};

class IpcMemory {
  public:
    virtual ~IpcMemory() = default;
    virtual MemoryKind kind() const = 0;
    virtual int device() const = 0;                            // CUDA device ordinal; -1 for host memory
    virtual std::unique_ptr<DeviceBinding> bind_device() = 0;  // Transport::bind_device; nullptr for host memory
    // Sizes of allocations and offsets inside views are multiples of this.
    virtual size_t granularity() const = 0;
    // A zero-filled allocation of mapped_bytes (a granularity multiple), mapped here. exported: device memory also
    // gets a descriptor for peers in `fd` (host memory always has its memfd there).
    virtual IpcMapping create(size_t mapped_bytes, bool exported) = 0;
    // Maps a peer's allocation from the descriptor it exported and keeps what maps it again (host: a dup of fd;
    // device: the imported handle). The caller keeps and closes fd.
    virtual IpcMapping map_peer(int fd, size_t mapped_bytes) = 0;
    // Unmaps a map_peer mapping and closes / releases what it kept. Never throws.
    virtual void unmap_peer(IpcMapping& peer) noexcept = 0;
    // Unmaps and frees an allocation made by create() (closes its fd when still open). Never throws.
    virtual void destroy(IpcMapping& local) noexcept = 0;

    // Views. reserve: `bytes` (a granularity multiple) of address space with nothing mapped.
    virtual uint8_t* reserve(size_t bytes) = 0;
    // Maps all of `memory` (its fd or handle, mapped_bytes) read/write at `address`, inside a reserved range.
    virtual void map_at(uint8_t* address, const IpcMapping& memory) = 0;
    // Unmaps what map_at placed ((offset, bytes) pairs from base) and frees the reserved range; device memory first
    // waits for the device. Never throws.
    virtual void free_range(uint8_t* base, size_t bytes,
                            const std::vector<std::pair<size_t, size_t>>& mapped) noexcept = 0;
};

// The host-memory (memfd) IpcMemory.
std::unique_ptr<IpcMemory> make_host_ipc_memory();

}  // namespace flatep::transport
