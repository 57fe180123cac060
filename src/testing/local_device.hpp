// `local` transport on GPUs (design §7): R ranks in one process, either R virtual ranks on one GPU (one device
// allocation holds every rank's symmetric region; peer pointers point into it) or one rank per GPU with peer
// access. Each rank gets its own stream, its barrier epoch in device memory, a host-mapped sync::WaitRecord and an SM
// budget (num_sms(): pass it to every launch) so that all ranks' kernels are co-resident on a shared GPU: a kernel
// spinning on a peer's flag never starves that peer.
//
//   LocalDeviceGroup group(8);                       // 8 virtual ranks on the current GPU
//   auto regions = group.allocate(bytes);            // regions[r].peers[p] = rank p's region
//   sync::SyncArgs sync = group.sync_args(r, regions, sym.barrier_offset, sym.status_offset);
//   kernels::launch(args_of_rank_r, group.stream(r), group.num_sms());
//
// Streams of one GPU must map to distinct hardware queues, or a spinning kernel of one rank can block a peer's
// kernel queued behind it: the constructor sets CUDA_DEVICE_MAX_CONNECTIONS=32 when it is unset, which only takes
// effect if no CUDA call was made before (tests and benchmarks construct the group first, or set the variable).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "flatep/transport.hpp"
#include "sync/sync.hpp"

namespace flatep::testing {

class LocalDeviceGroup {
  public:
    // device_per_rank: rank r on GPU r (needs num_ranks GPUs and peer access); otherwise every rank on the current
    // GPU. num_sms: every rank's SM budget, the most thread blocks one launch uses (0: two blocks on each of a rank's
    // share of the SMs, SMs / num_ranks, on a shared GPU; no cap with one rank per GPU).
    explicit LocalDeviceGroup(int num_ranks, bool device_per_rank = false, double timeout_s = 30.0, int num_sms = 0);
    ~LocalDeviceGroup();
    LocalDeviceGroup(const LocalDeviceGroup&) = delete;
    LocalDeviceGroup& operator=(const LocalDeviceGroup&) = delete;

    int num_ranks() const { return num_ranks_; }
    int device(int rank) const { return devices_[rank]; }
    cudaStream_t stream(int rank) const { return streams_[rank]; }
    int num_sms() const { return num_sms_; }
    double timeout_s() const { return timeout_s_; }

    // One zero-filled symmetric region of `bytes` per rank (256-byte aligned); regions[r].peers[p] is rank p's.
    std::vector<SymmetricRegion> allocate(size_t bytes);
    // Frees what allocate returned (never throws).
    void release(std::vector<SymmetricRegion>& regions) noexcept;

    // sync::SyncArgs of `rank` for a buffer whose flag array and status words sit at these offsets of every region.
    sync::SyncArgs sync_args(int rank, const std::vector<SymmetricRegion>& regions, int64_t barrier_offset,
                             int64_t status_offset) const;

    // Host view of rank's sync::WaitRecord (host-mapped; readable while kernels run).
    const sync::WaitRecord& wait_record(int rank) const { return host_records_[rank]; }
    // Zeroes every sync::WaitRecord (between tests).
    void clear_wait_records();

    // Waits for every rank's stream.
    void synchronize();

  private:
    int num_ranks_;
    bool device_per_rank_;
    double timeout_s_;
    int num_sms_ = 0;
    std::vector<int> devices_;
    std::vector<cudaStream_t> streams_;
    std::vector<uint64_t*> epochs_;  // device memory, one counter per rank
    sync::WaitRecord* host_records_ = nullptr;
    sync::WaitRecord* device_records_ = nullptr;
    struct Allocation {
        std::vector<void*> bases;  // one (shared GPU) or one per rank
    };
    std::vector<Allocation> allocations_;
};

}  // namespace flatep::testing
