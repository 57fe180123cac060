// Transport interface (design §7): allocates symmetric regions (same size on every rank, every rank's region
// mapped in every process) and runs small all-gathers for bootstrap. It hands out pointers and nothing else:
// kernels and host ops never call a transport, they take the pointers in their Args.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
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
    // Handle of this rank's physical memory, for mapping it again at another address (ExpertPools' compute
    // views): a memfd for host memory, a CUmemGenericAllocationHandle for device memory; -1 / 0 when none.
    int local_fd = -1;
    uint64_t local_handle = 0;
    int id = -1;  // transport-private identifier
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
    double timeout_s() const { return timeout_s_; }
    // seconds: finite, in (0, 86400] (one day); anything else (NaN, infinity, 0, negative) is kInvalidArgument.
    void set_timeout_s(double seconds) {
        if (!(seconds > 0 && seconds <= 86400)) {  // NaN fails every comparison
            std::ostringstream text;
            text << "Transport: timeout_s must be a finite number of seconds in (0, 86400], got " << seconds;
            throw Error(ErrorCategory::kInvalidArgument, __FILE__, __LINE__, text.str());
        }
        timeout_s_ = seconds;
    }

  protected:
    double timeout_s_ = 100.0;
};

}  // namespace flatep
