// The CUDA side of a Buffer: per-buffer device state (barrier epoch in device memory, host-mapped wait record, plan
// workspace) and the launches of the kernels library. Compiled in every build; without CUDA every entry point
// throws a clear error, so the runtime itself has no #ifdef ladders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "common/log.hpp"
#include "flatep/transport.hpp"
#include "ops/combine_args.hpp"
#include "ops/combine_grad_args.hpp"
#include "ops/dispatch_args.hpp"
#include "ops/dispatch_fp8_args.hpp"
#include "ops/entry_values_args.hpp"
#include "ops/plan_args.hpp"

namespace flatep::device {

bool built_with_cuda();

// Destroys `state` (whose destructor frees device memory) with the transport's device bound (Transport::bind_device):
// the memory is freed on its GPU from whatever thread drops the owner. Never throws (logs).
template <typename State>
void reset_on_device(Transport& transport, std::unique_ptr<State>& state, const char* owner) noexcept {
    if (state == nullptr) return;
    try {
        const std::unique_ptr<DeviceBinding> bound = transport.bind_device();
        state.reset();
    } catch (const std::exception& e) {
        FLATEP_LOG_WARN(owner, ": cannot bind the transport's device to free its device state: ", e.what());
        state.reset();
    }
}

// A sync::WaitRecord and a twin of the status words (sync/sync.hpp) in host-mapped pinned memory: the GPU writes a
// rank's first failed wait, and the first error an op records (a bad expert id), into it; the host reads both at
// every op's entry without any synchronisation. Empty in builds without CUDA.
class WaitRecordHost {
  public:
    WaitRecordHost();
    ~WaitRecordHost();  // never throws
    WaitRecordHost(const WaitRecordHost&) = delete;
    WaitRecordHost& operator=(const WaitRecordHost&) = delete;

    sync::WaitRecord* device_pointer() const { return &device_->wait; }
    int32_t* status_device_pointer() const { return device_->status; }  // sync::SyncArgs::host_status
    // Takes the status words (sync::StatusWord) the GPU recorded in host-mapped memory, if any (code != 0): copies them to
    // `words`, clears the host copy and returns true. No synchronisation.
    bool take_status(int32_t words[4]);
    // "" while no wait failed; else the failure's one-line text (e.g. "timeout in plan (GPU): rank 0 waited for peer
    // 1 (flag 0 < expected 1)", or a mismatch naming both ops and steps).
    std::string failure_message() const;
    int32_t failure_code() const;  // 0 or the sync::WaitRecord's sync::StatusCode

  private:
    struct Mapped {
        sync::WaitRecord wait;
        int32_t status[4];
    };
    Mapped* host_ = nullptr;
    Mapped* device_ = nullptr;
};

class Context {
  public:
    // Allocates the per-buffer device state on the current device (the caller binds the transport's device around
    // construction and destruction: Transport::bind_device). The SM budget starts at FLATEP_SM_BUDGET.
    explicit Context(const Layout& layout);
    ~Context();  // never throws
    Context(const Context&) = delete;
    Context& operator=(const Context&) = delete;

    // Fills the CUDA-only fields of a sync::SyncArgs (epoch pointer, wait record, SM budget).
    void fill_sync(sync::SyncArgs& sync) const;
    void* workspace() const { return workspace_; }
    int max_blocks() const { return max_blocks_; }             // SM budget per launch (0: no cap)
    void set_max_blocks(int blocks) { max_blocks_ = blocks; }  // checked by the caller (Buffer::set_max_blocks)

    // Launches on `stream` (a cudaStream_t; null = the legacy default stream).
    void plan(const PlanArgs& args, void* stream) const;
    void dispatch(const DispatchArgs& args, void* stream) const;
    void dispatch_fp8(const DispatchFp8Args& args, void* stream) const;
    void combine(const CombineArgs& args, void* stream) const;
    void entry_values(const EntryValuesArgs& args, void* stream) const;
    void combine_grad(const CombineGradArgs& args, void* stream) const;  // local: no barrier

    // Synchronising reads for diagnostics (check_status, plan accessors): waits for `stream`, then copies.
    void read(void* host_dst, const void* device_src, size_t bytes, void* stream) const;
    void zero(void* device_dst, size_t bytes, void* stream) const;
    // First failed wait recorded by this buffer's kernels ("" when none), read without synchronisation.
    std::string failure_message() const { return wait_.failure_message(); }
    int32_t failure_code() const { return wait_.failure_code(); }
    bool take_status(int32_t words[4]) { return wait_.take_status(words); }

  private:
    uint64_t* epoch_ = nullptr;  // device
    WaitRecordHost wait_;
    void* workspace_ = nullptr;
    int max_blocks_ = 0;
};

// The CUDA plan op of args.rank on `stream` (collective: every rank launches it on its own stream): the kernels'
// histogram and all-gather, the GPU planner, the kernels' routing and unpack (kernels/plan/plan.cuh,
// planner/gpu_planner.cuh). args.workspace: plan_workspace_bytes(layout) bytes of device memory, or null (then a
// scratch the kernels library keeps). Context::plan runs it; tests and benchmarks call it directly.
void launch_plan(const PlanArgs& args, void* stream);
size_t plan_workspace_bytes(const Layout& layout);

// Waits for all work of the transport's device (construction-time only: e.g. the transport's zero-fill of new regions
// runs on the legacy stream, which the ops' streams do not wait for).
void synchronize_device(Transport& transport);

// Synchronising copy of device memory to the host (waits for the whole of the transport's device first).
void copy_to_host(void* host_dst, const void* device_src, size_t bytes, Transport& transport);

// Device memory for a plan on the transport's device: `words` int32 words, freed (on that device, from any thread)
// when the last owner goes (the memory keeps the transport alive until then).
std::shared_ptr<int32_t> allocate_words(size_t words, std::shared_ptr<Transport> transport);

}  // namespace flatep::device
