// The CUDA backend of Buffer and ExpertPools (runtime/backend.hpp): every op is enqueued on its launch's stream with
// its SM budget and never synchronises with the host. The per-object device state (barrier epoch, host-mapped wait
// record, plan workspace and slots) lives on the transport's GPU, created and freed with that GPU bound
// (Transport::bind_device), whatever thread builds or drops the object.
#include <algorithm>
#include <memory>
#include <vector>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"
#include "runtime/backend.hpp"
#include "runtime/device_ops.hpp"
#include "runtime/plan_data.hpp"

#if defined(FLATEP_WITH_CUDA)
#include <cuda_runtime.h>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/preload.hpp"
#include "planner/gpu_planner.cuh"
#endif

namespace flatep::runtime {

#if defined(FLATEP_WITH_CUDA)

namespace {

cudaStream_t as_stream(const Launch& launch) { return static_cast<cudaStream_t>(launch.stream); }

// What both device backends share: the barrier epoch words and the host-mapped wait record on the transport's GPU.
template <class Base>
class DeviceOps : public Base {
  public:
    explicit DeviceOps(std::shared_ptr<Transport> transport) : transport_(std::move(transport)) {
        const std::unique_ptr<DeviceBinding> bound = transport_->bind_device();
        kernels::preload_all_kernels();  // no lazy module load while a peer's kernel spins (kernels/common/preload.hpp)
        planner::preload_planner_kernels();
        wait_ = std::make_unique<WaitRecordHost>();
        FLATEP_CUDA_CHECK(cudaMalloc(&epoch_, sync::kEpochWords * sizeof(uint64_t)));
        FLATEP_CUDA_CHECK(cudaMemset(epoch_, 0, sync::kEpochWords * sizeof(uint64_t)));
        num_sms_ = env::num_sms();
    }
    ~DeviceOps() override {
        try {
            const std::unique_ptr<DeviceBinding> bound = transport_->bind_device();
            free_state();
        } catch (const std::exception& e) {
            FLATEP_LOG_WARN("cannot bind the transport's device to free its device state: ", e.what());
            free_state();
        }
    }
    bool on_device() const override { return true; }
    int default_num_sms() const override { return num_sms_; }
    std::string failure_message() const override { return wait_->failure_message(); }
    int32_t failure_code() const override { return wait_->failure_code(); }
    bool take_status(int32_t words[4], int32_t* status, const Launch& launch) override {
        if (!wait_->take_status(words)) return false;
        zero(status, 4 * sizeof(int32_t), launch);  // stream-ordered: the device copy is reported here too
        return true;
    }
    void read_status(int32_t words[4], const int32_t* status, const Launch& launch) override {
        FLATEP_CUDA_CHECK(cudaStreamSynchronize(as_stream(launch)));  // the record is complete now
        FLATEP_CUDA_CHECK(cudaMemcpy(words, status, 4 * sizeof(int32_t), cudaMemcpyDeviceToHost));
    }
    void clear_status(int32_t* status, const Launch& launch) override {
        int32_t words[4];
        zero(status, sizeof(words), launch);
        wait_->take_status(words);  // the host-mapped twin holds the same error: it is reported now
    }
    void synchronize() override { synchronize_device(*transport_); }
    void watch_site(const CollectiveSite&) override {}
    void fill_sync(sync::SyncArgs& sync) const override {
        sync.epoch = epoch_;
        sync.wait_record = wait_->device_pointer();
        sync.host_status = wait_->status_device_pointer();
    }

  protected:
    // A collective op: its barrier state filled in, then its kernel on the launch's stream.
    template <class Args>
    void launch_collective(Args& args, const Launch& launch) const {
        fill_sync(args.sync);
        kernels::launch(args, as_stream(launch), launch.num_sms);
    }
    void zero(void* device_dst, size_t bytes, const Launch& launch) const {
        FLATEP_CUDA_CHECK(cudaMemsetAsync(device_dst, 0, bytes, as_stream(launch)));
    }
    std::shared_ptr<Transport> transport_;

  private:
    void free_state() noexcept {
        if (epoch_ != nullptr && cudaFree(epoch_) != cudaSuccess) FLATEP_LOG_WARN("cudaFree(epoch) failed");
        epoch_ = nullptr;
        wait_.reset();
    }
    uint64_t* epoch_ = nullptr;
    std::unique_ptr<WaitRecordHost> wait_;
    int num_sms_ = 0;
};

// The overrides of the ops of runtime/op_list.hpp: a collective op's barrier state, then its launch.
#define FLATEP_DEVICE_OP_collective(method, Args) \
    void method(Args& args, const Launch& launch) override { launch_collective(args, launch); }
#define FLATEP_DEVICE_OP_local(method, Args)                       \
    void method(const Args& args, const Launch& launch) override { \
        kernels::launch(args, as_stream(launch), launch.num_sms);  \
    }
#define FLATEP_DEVICE_OP(method, Args, kind) FLATEP_DEVICE_OP_##kind(method, Args)

class DeviceBufferBackend final : public DeviceOps<BufferBackend> {
  public:
    explicit DeviceBufferBackend(const BufferSite& site)
        : DeviceOps(site.transport), num_plan_slots_(site.num_plan_slots), plan_words_(site.plan_words) {
        const std::unique_ptr<DeviceBinding> bound = transport_->bind_device();
        FLATEP_CUDA_CHECK(cudaMalloc(&workspace_, plan_workspace_bytes(*site.layout)));
        if (num_plan_slots_ > 0)
            plan_slots_ = allocate_words(size_t(num_plan_slots_) * size_t(plan_words_), transport_);
        slot_generations_ = std::make_shared<std::vector<uint64_t>>(size_t(num_plan_slots_), 0);
    }
    ~DeviceBufferBackend() override {
        try {
            const std::unique_ptr<DeviceBinding> bound = transport_->bind_device();
            free_device_memory();
        } catch (const std::exception& e) {
            FLATEP_LOG_WARN("Buffer: cannot bind the transport's device to free its workspace: ", e.what());
            free_device_memory();
        }
    }

    void plan(PlanArgs& args, Plan::Data& data, int32_t* storage, const Launch& launch) override {
        const int64_t words = plan_words_;
        if (storage != nullptr) {
            data.device_words = std::shared_ptr<int32_t>(storage, [](int32_t*) {});  // the caller's memory
        } else {
            FLATEP_CHECK(num_plan_slots_ > 0,
                         "plan: this Buffer has no plan slots (num_plan_slots=0): pass plan_storage of ",
                         "plan_words()=", words, " int32");
            data.slot = int((data.generation - 1) % uint64_t(num_plan_slots_));
            (*slot_generations_)[size_t(data.slot)] = data.generation;
            data.slot_generations = slot_generations_;
            data.device_words = std::shared_ptr<int32_t>(plan_slots_, plan_slots_.get() + data.slot * words);
        }
        data.device_view = make_plan_view(data.host.layout, data.device_words.get());
        data.refresh_host = [words, source = data.device_words, transport = transport_](planner::HostPlan& host) {
            copy_to_host(host.view.tpe_all, source.get(), size_t(words) * sizeof(int32_t), *transport);  // view base
        };
        zero(data.device_words.get(), size_t(words) * sizeof(int32_t), launch);  // ordered on the stream
        args.plan = data.device_view;
        args.workspace = workspace_;
        fill_sync(args.sync);
        launch_plan(args, launch.stream, launch.num_sms);
    }
    void dispatch(DispatchArgs& args, const Launch& launch) override {
        args.marks_valid = recv_marks_valid_;
        launch_collective(args, launch);
        recv_marks_valid_ = true;  // this launch marks every row (stream order: the next dispatch sees them)
    }
    FLATEP_BUFFER_OPS(FLATEP_DEVICE_OP)
    const int32_t* store_placement(const std::vector<int32_t>& table, const Launch& launch) override {
        const std::unique_ptr<DeviceBinding> bound = transport_->bind_device();
        const size_t bytes = table.size() * sizeof(int32_t);
        if (placement_ == nullptr) {  // the first placement: its memory, kept for every later one (same size)
            FLATEP_CUDA_CHECK(cudaMalloc(&placement_, bytes));
            FLATEP_CUDA_CHECK(cudaHostAlloc(&placement_staging_, bytes, cudaHostAllocDefault));
            FLATEP_CUDA_CHECK(cudaEventCreateWithFlags(&placement_copied_, cudaEventDisableTiming));
        } else {
            FLATEP_CUDA_CHECK(cudaEventSynchronize(placement_copied_));  // the previous copy has read the staging
        }
        std::copy(table.begin(), table.end(), placement_staging_);
        FLATEP_CUDA_CHECK(
            cudaMemcpyAsync(placement_, placement_staging_, bytes, cudaMemcpyHostToDevice, as_stream(launch)));
        FLATEP_CUDA_CHECK(cudaEventRecord(placement_copied_, as_stream(launch)));
        return placement_;
    }

  private:
    void free_device_memory() noexcept {
        if (workspace_ != nullptr && cudaFree(workspace_) != cudaSuccess) FLATEP_LOG_WARN("Buffer: cudaFree failed");
        workspace_ = nullptr;
        // The placement: its copy may still be in flight when the Buffer goes.
        if (placement_copied_ != nullptr && cudaEventSynchronize(placement_copied_) != cudaSuccess)
            FLATEP_LOG_WARN("Buffer: waiting for the placement's copy failed");
        if (placement_ != nullptr && cudaFree(placement_) != cudaSuccess) FLATEP_LOG_WARN("Buffer: cudaFree failed");
        if (placement_staging_ != nullptr && cudaFreeHost(placement_staging_) != cudaSuccess)
            FLATEP_LOG_WARN("Buffer: cudaFreeHost failed");
        if (placement_copied_ != nullptr && cudaEventDestroy(placement_copied_) != cudaSuccess)
            FLATEP_LOG_WARN("Buffer: cudaEventDestroy failed");
        placement_ = nullptr;
        placement_staging_ = nullptr;
        placement_copied_ = nullptr;
    }
    int32_t* placement_ = nullptr;          // the static planner's placement table (device memory)
    int32_t* placement_staging_ = nullptr;  // its pinned host copy, read by the last cudaMemcpyAsync
    cudaEvent_t placement_copied_ = nullptr;
    int num_plan_slots_;
    int64_t plan_words_;
    void* workspace_ = nullptr;
    std::shared_ptr<int32_t> plan_slots_;                      // num_plan_slots_ * plan_words_ int32
    std::shared_ptr<std::vector<uint64_t>> slot_generations_;  // generation each slot holds now
    bool recv_marks_valid_ = false;  // a dispatch has marked the receive region's rows (DispatchArgs::marks_valid)
};

class DevicePoolsBackend final : public DeviceOps<PoolsBackend> {
  public:
    using DeviceOps::DeviceOps;
    FLATEP_POOLS_OPS(FLATEP_DEVICE_OP)
};

}  // namespace

std::unique_ptr<BufferBackend> make_device_buffer_backend(const BufferSite& site) {
    return std::make_unique<DeviceBufferBackend>(site);
}

std::unique_ptr<PoolsBackend> make_device_pools_backend(std::shared_ptr<Transport> transport) {
    return std::make_unique<DevicePoolsBackend>(std::move(transport));
}

#else  // no CUDA in this build

namespace {
[[noreturn]] void no_cuda() {
    FLATEP_THROW(ErrorCategory::kRuntime, "this FlatEP build has no CUDA support (nvcc was not found at build time)");
}
}  // namespace

std::unique_ptr<BufferBackend> make_device_buffer_backend(const BufferSite&) { no_cuda(); }
std::unique_ptr<PoolsBackend> make_device_pools_backend(std::shared_ptr<Transport>) { no_cuda(); }

#endif

}  // namespace flatep::runtime
