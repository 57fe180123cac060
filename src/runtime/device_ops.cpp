#include "runtime/device_ops.hpp"

#include <exception>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"

#if defined(FLATEP_WITH_CUDA)
#include <cuda_runtime.h>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/preload.hpp"
#include "kernels/plan/plan.cuh"
#include "planner/gpu_planner.cuh"
#include "sync/barrier_host.hpp"

#include <atomic>

#endif

namespace flatep::runtime {

#if defined(FLATEP_WITH_CUDA)

bool built_with_cuda() { return true; }

namespace {
cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Loads the planner's kernels on the current device before its first plan op there (once per device). The runtime's
// device backend preloads them with the kernels' own; this covers the callers that only preload the kernels library
// (tests and benchmarks on LocalDeviceGroup): its first plan op runs before any kernel of a peer spins.
void preload_planner_once() {
    static std::atomic<uint64_t> loaded{0};  // bit d: device d
    int device = 0;
    FLATEP_CUDA_CHECK(cudaGetDevice(&device));
    const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
    if (bit != 0 && (loaded.load(std::memory_order_acquire) & bit) != 0) return;
    planner::preload_planner_kernels();
    loaded.fetch_or(bit, std::memory_order_acq_rel);
}
}  // namespace

// The plan op's workspace: the kernels' part, then the planner's at a 256-byte boundary.
size_t plan_kernels_part(const Layout& l) { return (kernels::plan_kernels_workspace_bytes(l) + 255) / 256 * 256; }

size_t plan_workspace_bytes(const Layout& l) { return plan_kernels_part(l) + planner::planner_workspace_bytes(l); }

void launch_plan(const PlanArgs& a, void* stream, int num_sms) {
    const cudaStream_t s = as_stream(stream);
    const Layout& l = a.layout;
    uint8_t* const ws = static_cast<uint8_t*>(kernels::prepare_plan(a, plan_workspace_bytes(l), s));
    preload_planner_once();
    kernels::launch_plan_counts(a, ws, s, num_sms);
    planner::launch_planner(l, a.planner, a.plan, ws + plan_kernels_part(l), planner::planner_engine(), s, a.placement);
    kernels::launch_plan_routes(a, ws, s, num_sms);
}

WaitRecordHost::WaitRecordHost() {
    FLATEP_CUDA_CHECK(cudaHostAlloc(&host_, sizeof(Mapped), cudaHostAllocMapped));
    *host_ = Mapped{};
    FLATEP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0));
}

WaitRecordHost::~WaitRecordHost() {
    if (host_ != nullptr && cudaFreeHost(host_) != cudaSuccess) FLATEP_LOG_WARN("WaitRecordHost: cudaFreeHost failed");
}

int32_t WaitRecordHost::failure_code() const {
    return static_cast<const volatile sync::WaitRecord*>(&host_->wait)
        ->code;  // written by the GPU, code last (sync.hpp)
}

bool WaitRecordHost::take_status(int32_t words[4]) {
    volatile int32_t* status = host_->status;
    if (status[sync::kStatusCode] == sync::kStatusOk) return false;
    std::atomic_thread_fence(std::memory_order_acquire);  // record_status publishes the code last
    for (int i = 0; i < 4; ++i) words[i] = status[i];
    for (int i = 3; i >= 0; --i) status[i] = 0;  // the code (word 0) last: the GPU may record the next error after it
    return true;
}

std::string WaitRecordHost::failure_message() const {
    const volatile sync::WaitRecord* r = &host_->wait;
    const int32_t code = r->code;
    if (code == 0) return "";
    std::atomic_thread_fence(std::memory_order_acquire);  // the fields were written before code
    if (code == sync::kStatusTimeout) {  // the GPU knows no wall time: name the flags instead of seconds
        return detail::concat("timeout in ", sync::op_name(sync::OpId(r->op)), " (GPU): rank ", r->rank,
                              " waited for peer ", r->peer, " (flag ", sync::flag_epoch(r->observed), " < expected ",
                              sync::flag_epoch(r->expected), ")");
    }
    return sync::host::wait_failure_message(code, sync::OpId(r->op), r->rank, r->peer, r->expected, r->observed,
                                            r->step, 0.0);
}

void synchronize_device(Transport& transport) {
    const std::unique_ptr<DeviceBinding> bound = transport.bind_device();
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
}

void copy_to_host(void* host_dst, const void* device_src, size_t bytes, Transport& transport) {
    const std::unique_ptr<DeviceBinding> bound = transport.bind_device();
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
    FLATEP_CUDA_CHECK(cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost));
}

std::shared_ptr<int32_t> allocate_words(size_t words, std::shared_ptr<Transport> transport) {
    const std::unique_ptr<DeviceBinding> bound = transport->bind_device();
    int32_t* ptr = nullptr;
    FLATEP_CUDA_CHECK(cudaMalloc(&ptr, words * sizeof(int32_t)));  // zeroed on the op's stream by the caller
    return std::shared_ptr<int32_t>(ptr, [transport](int32_t* p) {
        try {
            const std::unique_ptr<DeviceBinding> free_bound = transport->bind_device();
            if (cudaFree(p) != cudaSuccess) FLATEP_LOG_WARN("Plan: cudaFree failed");
        } catch (const std::exception& e) {
            FLATEP_LOG_WARN("Plan: cannot bind the transport's device to free its memory: ", e.what());
        }
    });
}

#else  // no CUDA in this build

bool built_with_cuda() { return false; }

namespace {
[[noreturn]] void no_cuda() {
    FLATEP_THROW(ErrorCategory::kRuntime, "this FlatEP build has no CUDA support (nvcc was not found at build time)");
}
}  // namespace

void launch_plan(const PlanArgs&, void*, int) { no_cuda(); }
size_t plan_workspace_bytes(const Layout&) { no_cuda(); }
size_t plan_kernels_part(const Layout&) { no_cuda(); }
WaitRecordHost::WaitRecordHost() = default;
WaitRecordHost::~WaitRecordHost() = default;
std::string WaitRecordHost::failure_message() const { return ""; }
int32_t WaitRecordHost::failure_code() const { return 0; }
bool WaitRecordHost::take_status(int32_t*) { return false; }
void synchronize_device(Transport&) { no_cuda(); }
void copy_to_host(void*, const void*, size_t, Transport&) { no_cuda(); }
std::shared_ptr<int32_t> allocate_words(size_t, std::shared_ptr<Transport>) { no_cuda(); }

#endif

}  // namespace flatep::runtime
