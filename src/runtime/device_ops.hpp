// CUDA helpers of the device backends (runtime/backend.hpp): the host-mapped wait record, the plan op's three launches,
// device memory for plans and synchronising copies. Compiled in every build; without CUDA every entry point throws a
// clear error, so the runtime itself has no #ifdef ladders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "flatep/transport.hpp"
#include "ops/plan_args.hpp"
#include "sync/sync.hpp"

namespace flatep::runtime {

bool built_with_cuda();

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
    // Takes the status words (sync::StatusWord) the GPU recorded in host-mapped memory, if any (code != 0): copies them
    // to `words`, clears the host copy and returns true. No synchronisation.
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

// The CUDA plan op of args.rank on `stream` (collective: every rank launches it on its own stream): the kernels'
// histogram and all-gather, the GPU planner, the kernels' routing and unpack (kernels/plan/plan.cuh,
// planner/gpu_planner.cuh). args.workspace: plan_workspace_bytes(layout) bytes of device memory, or null (then a
// scratch the kernels library keeps). num_sms: the SM budget of its launches (0: no cap). The device backend runs it;
// tests and benchmarks call it directly.
void launch_plan(const PlanArgs& args, void* stream, int num_sms);
size_t plan_workspace_bytes(const Layout& layout);
// Where the planner's part of that workspace starts (the kernels' part first, then the planner's at a 256-byte
// boundary): for benchmarks that launch the plan op's halves themselves.
size_t plan_kernels_part(const Layout& layout);

// Waits for all work of the transport's device (construction-time only: e.g. the transport's zero-fill of new regions
// runs on the legacy stream, which the ops' streams do not wait for).
void synchronize_device(Transport& transport);

// Synchronising copy of device memory to the host (waits for the whole of the transport's device first).
void copy_to_host(void* host_dst, const void* device_src, size_t bytes, Transport& transport);

// Device memory for a plan on the transport's device: `words` int32 words, freed (on that device, from any thread)
// when the last owner goes (the memory keeps the transport alive until then).
std::shared_ptr<int32_t> allocate_words(size_t words, std::shared_ptr<Transport> transport);

}  // namespace flatep::runtime
