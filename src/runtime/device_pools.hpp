// The CUDA side of ExpertPools (design §5): the launches of prefetch / reduce_grad / write_grads with a per-pools
// barrier epoch in device memory. (The layers' memory and compute views come from the transport: Transport::
// allocate_local / map_view.) Compiled in every build; without CUDA every entry point throws "this FlatEP build has
// no CUDA support".
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/grad_reduce_args.hpp"
#include "ops/prefetch_args.hpp"
#include "ops/write_grads_args.hpp"
#include "runtime/device_ops.hpp"

namespace flatep::device {

// Per-ExpertPools device state: the barrier epoch (device memory), the host-mapped wait record and the SM budget.
class PoolsContext {
  public:
    PoolsContext();   // on the current device: the caller binds the transport's (Transport::bind_device)
    ~PoolsContext();  // never throws
    PoolsContext(const PoolsContext&) = delete;
    PoolsContext& operator=(const PoolsContext&) = delete;

    // Fills the CUDA-only fields of a sync::SyncArgs (epoch pointer, SM budget).
    void fill_sync(sync::SyncArgs& sync) const;
    // Launch on `stream` (a cudaStream_t; null = the legacy default stream).
    void prefetch(const PrefetchArgs& args, void* stream) const;
    void grad_reduce(const GradReduceArgs& args, void* stream) const;
    void write_grads(const WriteGradsArgs& args, void* stream) const;  // local: no barrier
    int max_blocks() const { return max_blocks_; }                     // SM budget per launch (0: no cap)
    void set_max_blocks(int blocks) { max_blocks_ = blocks; }          // checked by ExpertPools::set_max_blocks
    // First failed wait recorded by the pools' kernels ("" when none), read without synchronisation.
    std::string failure_message() const { return wait_.failure_message(); }
    int32_t failure_code() const { return wait_.failure_code(); }

  private:
    uint64_t* epoch_ = nullptr;  // device
    WaitRecordHost wait_;
    int max_blocks_ = 0;
};

}  // namespace flatep::device
