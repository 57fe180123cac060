#include "testing/local_device.hpp"

#include <cstdlib>
#include <cstring>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"
#include "common/math.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "layout/layout.hpp"

namespace flatep::testing {

namespace {
constexpr size_t kRegionAlign = 2u << 20;  // 2 MiB: every rank's region starts on its own large page

class DeviceGuard {
  public:
    explicit DeviceGuard(int device) {
        cudaGetDevice(&saved_);
        FLATEP_CUDA_CHECK(cudaSetDevice(device));
    }
    ~DeviceGuard() { cudaSetDevice(saved_); }

  private:
    int saved_ = 0;
};
}  // namespace

LocalDeviceGroup::LocalDeviceGroup(int num_ranks, bool device_per_rank, double timeout_s, int num_sms)
    : num_ranks_(num_ranks),
      device_per_rank_(device_per_rank),
      timeout_s_(env::check_timeout("LocalDeviceGroup", "timeout_s", timeout_s)) {
    FLATEP_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "LocalDeviceGroup: num_ranks must be in [1, ", kMaxRanks,
                 "], got ", num_ranks);
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);  // CUDA_MODULE_LOADING stays as it is: every kernel is loaded below
    int current = 0;
    FLATEP_CUDA_CHECK(cudaGetDevice(&current));
    int count = 0;
    FLATEP_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device_per_rank) {
        FLATEP_CHECK(count >= num_ranks, "LocalDeviceGroup: one rank per GPU needs ", num_ranks, " GPUs, found ",
                     count);
    }
    for (int r = 0; r < num_ranks; ++r) devices_.push_back(device_per_rank ? r : current);
    if (device_per_rank) {
        for (int a = 0; a < num_ranks; ++a) {
            DeviceGuard guard(a);
            for (int b = 0; b < num_ranks; ++b) {
                if (a == b) continue;
                int can = 0;
                FLATEP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a, b));
                FLATEP_CHECK_RUNTIME(can == 1, "LocalDeviceGroup: GPU ", a, " cannot access GPU ", b);
                const cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
                if (err == cudaErrorPeerAccessAlreadyEnabled) {
                    cudaGetLastError();
                } else {
                    FLATEP_CUDA_CHECK(err);
                }
            }
        }
    } else {
        int sms = 0;
        FLATEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, current));
        const int per_rank = sms / num_ranks > 0 ? sms / num_ranks : 1;  // two blocks on each of its share of SMs
        num_sms_ = num_sms > 0 ? num_sms : (num_ranks > 1 ? per_rank * 2 : 0);
    }
    for (int r = 0; r < num_ranks; ++r) {
        DeviceGuard guard(devices_[r]);
        cudaStream_t s = nullptr;
        FLATEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        streams_.push_back(s);
        uint64_t* epoch = nullptr;
        FLATEP_CUDA_CHECK(cudaMalloc(&epoch, 256));
        FLATEP_CUDA_CHECK(cudaMemset(epoch, 0, 256));
        epochs_.push_back(epoch);
    }
    for (int r = 0; r < num_ranks; ++r) {
        if (r > 0 && devices_[r] == devices_[r - 1]) continue;
        DeviceGuard guard(devices_[r]);
        kernels::preload_all_kernels();
    }
    FLATEP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_records_), sizeof(sync::WaitRecord) * num_ranks,
                                    cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(host_records_, 0, sizeof(sync::WaitRecord) * num_ranks);
    FLATEP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_records_), host_records_, 0));
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
}

LocalDeviceGroup::~LocalDeviceGroup() {
    for (int r = 0; r < num_ranks_; ++r) {
        cudaSetDevice(devices_[r]);
        cudaStreamSynchronize(streams_[r]);
        cudaStreamDestroy(streams_[r]);
        cudaFree(epochs_[r]);
    }
    for (Allocation& a : allocations_)
        for (void* p : a.bases) cudaFree(p);
    if (host_records_ != nullptr) cudaFreeHost(host_records_);
}

std::vector<SymmetricRegion> LocalDeviceGroup::allocate(size_t bytes) {
    FLATEP_CHECK(bytes > 0, "LocalDeviceGroup::allocate: bytes must be positive");
    const size_t stride = round_up<size_t>(bytes, kRegionAlign);
    std::vector<SymmetricRegion> regions(num_ranks_);
    Allocation alloc;
    if (device_per_rank_) {
        for (int r = 0; r < num_ranks_; ++r) {
            DeviceGuard guard(devices_[r]);
            void* p = nullptr;
            FLATEP_CUDA_CHECK(cudaMalloc(&p, stride));
            FLATEP_CUDA_CHECK(cudaMemset(p, 0, stride));
            alloc.bases.push_back(p);
        }
    } else {
        void* p = nullptr;
        FLATEP_CUDA_CHECK(cudaMalloc(&p, stride * num_ranks_));
        FLATEP_CUDA_CHECK(cudaMemset(p, 0, stride * num_ranks_));
        alloc.bases.push_back(p);
    }
    for (int r = 0; r < num_ranks_; ++r) {
        SymmetricRegion& g = regions[r];
        g.bytes = bytes;
        g.mapped_bytes = stride;
        g.id = int(allocations_.size());
        for (int p = 0; p < num_ranks_; ++p) {
            g.peers[p] = device_per_rank_ ? static_cast<uint8_t*>(alloc.bases[p])
                                          : static_cast<uint8_t*>(alloc.bases[0]) + stride * p;
        }
        g.local = g.peers[r];
    }
    allocations_.push_back(alloc);
    FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
    return regions;
}

void LocalDeviceGroup::release(std::vector<SymmetricRegion>& regions) noexcept {
    if (regions.empty()) return;
    const int id = regions[0].id;
    if (id >= 0 && id < int(allocations_.size())) {
        for (void* p : allocations_[id].bases) {
            if (cudaFree(p) != cudaSuccess) FLATEP_LOG_WARN("LocalDeviceGroup::release: cudaFree failed");
        }
        allocations_[id].bases.clear();
    }
    regions.clear();
}

sync::SyncArgs LocalDeviceGroup::sync_args(int rank, const std::vector<SymmetricRegion>& regions,
                                           int64_t barrier_offset, int64_t status_offset) const {
    sync::SyncArgs s{};
    for (int p = 0; p < num_ranks_; ++p) s.flags[p] = region_at<uint64_t>(regions[rank].peers[p], barrier_offset);
    s.epoch = epochs_[rank];
    s.status = region_at<int32_t>(regions[rank].local, status_offset);
    s.rank = rank;
    s.num_ranks = num_ranks_;
    s.timeout_s = timeout_s_;
    s.wait_record = device_records_ + rank;
    return s;
}

void LocalDeviceGroup::clear_wait_records() { std::memset(host_records_, 0, sizeof(sync::WaitRecord) * num_ranks_); }

void LocalDeviceGroup::synchronize() {
    for (int r = 0; r < num_ranks_; ++r) {
        DeviceGuard guard(devices_[r]);
        FLATEP_CUDA_CHECK(cudaStreamSynchronize(streams_[r]));
    }
}

}  // namespace flatep::testing
