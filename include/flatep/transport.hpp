// Transport interface (design §7): allocates symmetric regions (same size on every rank, every rank's region
// mapped in every process), memory of one rank alone, views that place both back to back in one address range, and
// runs small all-gathers for bootstrap. It hands out pointers and nothing else: kernels and host ops never call a
// transport, they take the pointers in their Args.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flatep/error.hpp"
#include "flatep/types.hpp"

namespace flatep {

enum class MemoryKind : int { kHost = 0, kDevice = 1 };

struct SymmetricRegion {
    size_t bytes = 0;                // usable size requested by the caller
    size_t mapped_bytes = 0;         // size of each mapping (rounded up to the allocation granularity)
    uint8_t* local = nullptr;        // this rank's region (== peers[rank])
    uint8_t* peers[kMaxRanks] = {};  // every rank's region as mapped in this process
    // Handle of this rank's physical memory: a memfd for host memory, a CUmemGenericAllocationHandle for device
    // memory; -1 / 0 when none. (To map a region again, use Transport::map_view, which also maps peers' regions.)
    int local_fd = -1;
    uint64_t local_handle = 0;
    int id = -1;  // the region's identifier (the same on every rank: allocate is collective); ViewPiece::region_id
};

// Memory of this rank alone (peers never map it), zero-filled, that views may map.
struct LocalMemory {
    uint8_t* ptr = nullptr;  // mapped in this process (device memory for a device transport)
    size_t bytes = 0;        // mapped size: the requested size rounded up to Transport::granularity()
    int id = -1;             // ViewPiece::local_id
};

// One piece of a view: the whole of an allocation (its mapped bytes) placed at byte `offset` of the view.
// Exactly one of region_id (a SymmetricRegion's id, with `rank`: whose region -- this rank's or any peer's) and
// local_id (a LocalMemory's id) is >= 0.
struct ViewPiece {
    int region_id = -1;
    int rank = 0;
    int local_id = -1;
    size_t offset = 0;
};

// One reserved address range of `bytes` with pieces mapped into it (Transport::map_view).
struct MappedView {
    uint8_t* base = nullptr;
    size_t bytes = 0;
    int id = -1;  // transport-private identifier
};

// What Transport::bind_device returns: while it lives, the transport's device context is current on the thread that
// bound it; destroying it (on that thread) makes the context that was current before current again. Never throws.
class DeviceBinding {
  public:
    virtual ~DeviceBinding() = default;
};

// Small-blob all-gather plus rank/size: the bootstrap every transport is built on (fork launcher, socket
// rendezvous, torch.distributed, or threads of one process).
class Bootstrap {
  public:
    virtual ~Bootstrap() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    // Collective: every rank passes its blob; returns all blobs indexed by rank. Throws a timeout error naming the
    // missing peer when a rank does not arrive within the transport's timeout.
    virtual std::vector<std::string> all_gather(const std::string& blob) = 0;
};

class Transport {
  public:
    virtual ~Transport() = default;
    virtual int rank() const = 0;
    virtual int num_ranks() const = 0;
    virtual MemoryKind memory_kind() const = 0;
    virtual const char* name() const = 0;  // "local", "ipc"
    // Collective: every rank calls with the same `bytes`. Returns a zero-filled region mapped on every rank.
    virtual SymmetricRegion allocate(size_t bytes) = 0;
    // Collective counterpart of allocate; never throws (logs and keeps the first error).
    virtual void release(SymmetricRegion& region) noexcept = 0;
    virtual Bootstrap& bootstrap() = 0;

    // CUDA device ordinal of this transport's memory (MemoryKind::kDevice), -1 for host memory. Every driver call of
    // the transport runs in that device's primary context (torch's), retained by the transport and bound by it
    // whatever the calling thread has current.
    virtual int device() const = 0;
    // Makes that context current on the calling thread until the returned object is destroyed (on the same thread);
    // nullptr (nothing to bind) for host memory. The runtime allocates and frees its own device state (barrier epochs,
    // workspaces, plans) inside one, so objects built and dropped on any thread land on device(). Throws kRuntime
    // when the context cannot be made current.
    virtual std::unique_ptr<DeviceBinding> bind_device() = 0;

    // Unit of region sizes, local memory sizes and view offsets: the page size for host memory, the CUDA VMM
    // allocation granularity for device memory.
    virtual size_t granularity() const = 0;
    // Local (not collective): zero-filled memory of this rank alone of `bytes` (> 0) rounded up to the granularity.
    virtual LocalMemory allocate_local(size_t bytes) = 0;
    // Unmaps and frees local memory (its contents live on in the views that map it). Never throws; a second call,
    // or a LocalMemory{}, is a no-op.
    virtual void release_local(LocalMemory& memory) noexcept = 0;
    // Local: reserves `bytes` (a granularity multiple) of address space and maps each piece at its offset
    // (multiples of the granularity, inside [0, bytes), not overlapping; gaps stay unmapped / inaccessible).
    // Peers' regions are mapped read/write too (the serving view reads experts in place from their home rank).
    // Memory stays valid while a view maps it, even after release()/release_local() of its owner.
    // Bad arguments (sizes, offsets, overlaps, unknown ids) throw kInvalidArgument naming the piece.
    virtual MappedView map_view(size_t bytes, const std::vector<ViewPiece>& pieces) = 0;
    // Unmaps a view (device memory: after the device finished the work queued on it). Never throws; a second call,
    // or a MappedView{}, is a no-op.
    virtual void unmap_view(MappedView& view) noexcept = 0;

    double timeout_s() const { return timeout_s_; }
    // seconds: finite, in (0, 86400] (one day); anything else (NaN, infinity, 0, negative) is kInvalidArgument.
    void set_timeout_s(double seconds) {
        if (!(seconds > 0 && seconds <= 86400)) {  // NaN fails every comparison
            char value[64];                        // the value as given: shortest round-trip form
            const std::to_chars_result written = std::to_chars(value, value + sizeof(value), seconds);
            throw Error(ErrorCategory::kInvalidArgument, __FILE__, __LINE__,
                        "Transport: timeout_s must be a finite number of seconds in (0, 86400], got " +
                            std::string(value, written.ptr));
        }
        timeout_s_ = seconds;
    }

  protected:
    double timeout_s_ = 100.0;
};

}  // namespace flatep
