// The CUDA side of ExpertPools (design §5): a layer's own weights / grads as CUDA VMM allocations mapped in front of
// the pools' allocations (one reserved VA range per compute view, the device twin of the host path's memfd
// mappings), and the launches of prefetch / reduce_grad with a per-pools barrier epoch in device memory.
// Compiled in every build; without CUDA every entry point throws "this FlatEP build has no CUDA support".
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/grad_reduce_args.hpp"
#include "ops/prefetch_args.hpp"
#include "ops/write_grads_args.hpp"
#include "runtime/device_ops.hpp"

namespace flatep::device {

// One device allocation of a layer (cuMemCreate on the current device, zero-filled) and its two mappings.
struct LayerAllocation {
    uint64_t handle = 0;      // CUmemGenericAllocationHandle of the layer's memory
    size_t bytes = 0;         // allocation size (a granularity multiple); the layer's data ends at its end
    uint8_t* own = nullptr;   // the allocation alone [bytes]
    uint8_t* view = nullptr;  // one reserved range [view_bytes]: the allocation, then the pool's allocation
    size_t view_bytes = 0;    // bytes + the pool's mapped bytes
};

// Creates the allocation for `data_bytes` (rounded up to the allocation granularity) and maps it alone and in front
// of the pool allocation `pool_handle` (a CUmemGenericAllocationHandle of `pool_bytes`, a granularity multiple),
// both read/write for the current device. Throws kRuntime on any driver failure (nothing leaks).
LayerAllocation create_layer_allocation(size_t data_bytes, uint64_t pool_handle, size_t pool_bytes);
// Waits for the device, unmaps both ranges and releases the allocation. Never throws (logs failures).
void destroy_layer_allocation(LayerAllocation& allocation) noexcept;

// Per-ExpertPools device state: the barrier epoch (device memory), the host-mapped wait record and the SM budget.
class PoolsContext {
  public:
    PoolsContext();
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
