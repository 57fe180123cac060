// How the ipc transport creates, exports and maps one rank's region: memfd + mmap on the host
// (ipc_transport.cpp), CUDA VMM with POSIX file-descriptor handles on the device (cuda/ipc_cuda_memory.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "flatep/transport.hpp"

namespace flatep {

struct IpcLocalMemory {
    uint8_t* ptr = nullptr;   // mapped in this process
    size_t mapped_bytes = 0;  // a multiple of the granularity
    int fd = -1;              // exportable descriptor (memfd, or the fd exported from the CUDA handle)
    uint64_t handle = 0;      // CUmemGenericAllocationHandle on the device; 0 on the host
};

class IpcMemory {
  public:
    virtual ~IpcMemory() = default;
    virtual MemoryKind kind() const = 0;
    // Sizes of regions are rounded up to this.
    virtual size_t granularity() const = 0;
    // A zero-filled region of mapped_bytes (a granularity multiple), mapped here, with an exported descriptor.
    virtual IpcLocalMemory create(size_t mapped_bytes) = 0;
    // Maps a peer's region from the descriptor it exported (the caller keeps and closes fd).
    virtual uint8_t* map_peer(int fd, size_t mapped_bytes) = 0;
    virtual void unmap_peer(uint8_t* ptr, size_t mapped_bytes) noexcept = 0;
    // Unmaps and frees a region made by create() (closes its fd when still open). Never throws.
    virtual void destroy(IpcLocalMemory& local) noexcept = 0;
};

}  // namespace flatep
