#include "transport/local_host.hpp"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"
#include "transport/host_memory.hpp"
#include "transport/ipc_memory.hpp"
#include "transport/memory_views.hpp"

namespace flatep::transport {

struct LocalHostWorld::State {
    struct Round {
        std::vector<std::string> blobs;
        std::vector<bool> present;
        int arrived = 0;
        int departed = 0;
    };
    explicit State(int n, double t) : num_ranks(n), timeout_s(t), next_round(n, 0), transports(n) {}

    std::vector<std::string> all_gather(int rank, const std::string& blob, double timeout);

    const int num_ranks;
    const double timeout_s;
    std::mutex mutex;
    std::condition_variable arrived_cv;
    std::map<uint64_t, Round> rounds;  // node-stable: waiters keep references across waits
    std::vector<uint64_t> next_round;  // per rank: index of its next all_gather
    std::vector<std::weak_ptr<Transport>> transports;
};

std::vector<std::string> LocalHostWorld::State::all_gather(int rank, const std::string& blob, double timeout) {
    std::unique_lock<std::mutex> lock(mutex);
    const uint64_t index = next_round[rank]++;
    Round& round = rounds[index];
    if (round.blobs.empty()) {
        round.blobs.resize(num_ranks);
        round.present.assign(num_ranks, false);
    }
    round.blobs[rank] = blob;
    round.present[rank] = true;
    ++round.arrived;
    arrived_cv.notify_all();
    const auto start = std::chrono::steady_clock::now();
    const auto deadline =
        start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout));
    if (!arrived_cv.wait_until(lock, deadline, [&] { return round.arrived == num_ranks; })) {
        int missing = -1;
        for (int p = 0; p < num_ranks && missing < 0; ++p) {
            if (!round.present[p]) missing = p;
        }
        // The configured limit (stable messages), as given.
        FLATEP_THROW(ErrorCategory::kTimeout, "timeout in all_gather: rank ", rank, " waited ",
                     detail::seconds_text(timeout), " s for peer ", missing, " (round ", index, ", ", round.arrived,
                     " of ", num_ranks, " ranks arrived)");
    }
    std::vector<std::string> result = round.blobs;
    if (++round.departed == num_ranks) rounds.erase(index);
    return result;
}

namespace {

class LocalHostTransport;

// Rank `rank` of the world's all-gather; each wait bounded by its owner transport's timeout (or, without an owner,
// by the world's).
class ThreadBootstrap : public Bootstrap {
  public:
    ThreadBootstrap(std::shared_ptr<LocalHostWorld::State> state, const Transport* owner, int rank)
        : state_(std::move(state)), owner_(owner), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return state_->num_ranks; }
    std::vector<std::string> all_gather(const std::string& blob) override {
        return state_->all_gather(rank_, blob, owner_ != nullptr ? owner_->timeout_s() : state_->timeout_s);
    }

  private:
    std::shared_ptr<LocalHostWorld::State> state_;
    const Transport* owner_;
    int rank_;
};

// What a rank publishes about one allocation: its memfd and sizes (one process, so the fd is valid everywhere).
struct RegionBlob {
    int32_t fd;
    uint64_t bytes;
    uint64_t mapped_bytes;
};

class LocalHostTransport : public Transport {
  public:
    LocalHostTransport(std::shared_ptr<LocalHostWorld::State> state, int rank)
        : state_(state),
          rank_(rank),
          bootstrap_(state, this, rank),
          memory_(make_host_ipc_memory()),
          views_(*memory_, state->num_ranks) {
        timeout_s_ = state->timeout_s;
    }
    ~LocalHostTransport() override {
        if (live_regions_ > 0)
            FLATEP_LOG_WARN("local transport rank ", rank_, ": ", live_regions_, " region(s) not released");
        for (auto& [id, fds] : region_fds_) close_all(fds);
    }
    int rank() const override { return rank_; }
    int num_ranks() const override { return state_->num_ranks; }
    MemoryKind memory_kind() const override { return MemoryKind::kHost; }
    const char* name() const override { return "local"; }
    Bootstrap& bootstrap() override { return bootstrap_; }
    int device() const override { return -1; }
    std::unique_ptr<DeviceBinding> bind_device() override { return nullptr; }
    size_t granularity() const override { return host_memory::page_size(); }
    LocalMemory allocate_local(size_t bytes) override { return views_.allocate_local(bytes); }
    void release_local(LocalMemory& memory) noexcept override { views_.release_local(memory); }
    void unmap_view(MappedView& view) noexcept override { views_.unmap_view(view); }

    MappedView map_view(size_t bytes, const std::vector<ViewPiece>& pieces) override {
        return views_.map_view(bytes, pieces, [this](int region_id, int rank) -> const IpcMapping* {
            const auto it = region_fds_.find(region_id);
            return it == region_fds_.end() ? nullptr : &it->second[rank];
        });
    }

    SymmetricRegion allocate(size_t bytes) override {
        FLATEP_CHECK(bytes > 0, "allocate: bytes must be positive, got ", bytes);
        const int num_ranks = state_->num_ranks;
        SymmetricRegion region;
        region.bytes = bytes;
        region.mapped_bytes = host_memory::round_up_pages(bytes);
        region.id = next_id_++;
        const std::string name = detail::concat("flatep-local-r", rank_, "-", region.id);
        region.local_fd = host_memory::create(region.mapped_bytes, name.c_str());
        RegionBlob mine{region.local_fd, bytes, region.mapped_bytes};
        std::vector<std::string> blobs;
        std::vector<IpcMapping> fds;
        try {
            blobs = bootstrap_.all_gather(std::string(reinterpret_cast<const char*>(&mine), sizeof(mine)));
            std::vector<RegionBlob> theirs(num_ranks);
            // Check every blob before mapping any fd: all ranks see the same blobs, so all of them throw here
            // together and nobody maps an fd its owner is about to close.
            for (int p = 0; p < num_ranks; ++p) {
                if (blobs[p].size() != sizeof(RegionBlob)) {  // a peer in another collective: its blob is no region
                    FLATEP_THROW(ErrorCategory::kMismatch, "allocate: rank ", rank_, " asked for ", bytes,
                                 " bytes but rank ", p, " is in another collective (it sent ", blobs[p].size(),
                                 " bytes, not a region's ", sizeof(RegionBlob), ")");
                }
                std::memcpy(&theirs[p], blobs[p].data(), sizeof(RegionBlob));
                if (theirs[p].bytes != bytes) {
                    FLATEP_THROW(ErrorCategory::kMismatch, "allocate: rank ", rank_, " asked for ", bytes,
                                 " bytes but rank ", p, " asked for ", theirs[p].bytes);
                }
            }
            fds.assign(num_ranks, IpcMapping{});
            for (int p = 0; p < num_ranks; ++p) {
                region.peers[p] = static_cast<uint8_t*>(host_memory::map(theirs[p].fd, theirs[p].mapped_bytes));
                // Views map every rank's region again, after its owner may have closed its fd: keep a dup.
                fds[p] = IpcMapping{region.peers[p], theirs[p].mapped_bytes, host_memory::dup_fd(theirs[p].fd), 0};
            }
            region.local = region.peers[rank_];
            // Every rank has mapped (and duplicated) every fd before any owner may close its fd (release).
            bootstrap_.all_gather("");
        } catch (...) {
            unmap_all(region);
            close_all(fds);
            host_memory::close_fd(region.local_fd);
            throw;
        }
        region_fds_.emplace(region.id, std::move(fds));
        ++live_regions_;
        return region;
    }

    void release(SymmetricRegion& region) noexcept override {
        if (region.local == nullptr && region.local_fd < 0) return;
        const auto it = region_fds_.find(region.id);
        // A stale copy of a released region (or another transport's) would unmap and close what a later
        // allocation got at the same address and descriptor number.
        if (it == region_fds_.end() || it->second[rank_].ptr != region.local) {
            FLATEP_LOG_WARN("local transport rank ", rank_, ": region id ", region.id,
                            " is not a live region of this transport; ignored");
            return;
        }
        close_all(it->second);
        region_fds_.erase(it);
        unmap_all(region);
        host_memory::close_fd(region.local_fd);
        region = SymmetricRegion{};
        --live_regions_;
    }

  private:
    static void close_all(std::vector<IpcMapping>& fds) noexcept {
        for (IpcMapping& m : fds) host_memory::close_fd(m.fd);
        fds.clear();
    }

    void unmap_all(SymmetricRegion& region) noexcept {
        for (int p = 0; p < kMaxRanks; ++p) {
            host_memory::unmap(region.peers[p], region.mapped_bytes);
            region.peers[p] = nullptr;
        }
        region.local = nullptr;
    }

    std::shared_ptr<LocalHostWorld::State> state_;
    int rank_;
    ThreadBootstrap bootstrap_;
    std::unique_ptr<IpcMemory> memory_;  // host memory: local memory and views
    MemoryViews views_;                  // over memory_ (destroyed first)
    // Per live region: every rank's mapping here and a dup of its memfd (what views map; ptr is region.peers[p]).
    std::map<int, std::vector<IpcMapping>> region_fds_;
    int next_id_ = 0;
    int live_regions_ = 0;
};

}  // namespace

LocalHostWorld::LocalHostWorld(int num_ranks, double timeout_s) {
    FLATEP_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "LocalHostWorld: num_ranks must be in [1, ", kMaxRanks,
                 "], got ", num_ranks);
    state_ = std::make_shared<State>(num_ranks, env::resolve_timeout("LocalHostWorld", timeout_s));
}

LocalHostWorld::~LocalHostWorld() = default;

int LocalHostWorld::num_ranks() const { return state_->num_ranks; }

std::shared_ptr<Transport> LocalHostWorld::transport(int rank) {
    FLATEP_CHECK(rank >= 0 && rank < state_->num_ranks, "LocalHostWorld::transport: rank must be in [0, ",
                 state_->num_ranks, "), got ", rank);
    std::lock_guard<std::mutex> lock(state_->mutex);
    std::shared_ptr<Transport> t = state_->transports[rank].lock();
    if (!t) {
        t = std::make_shared<LocalHostTransport>(state_, rank);
        state_->transports[rank] = t;
    }
    return t;
}

std::vector<std::shared_ptr<Bootstrap>> LocalHostWorld::bootstraps() {
    std::vector<std::shared_ptr<Bootstrap>> out;
    for (int r = 0; r < state_->num_ranks; ++r) out.push_back(std::make_shared<ThreadBootstrap>(state_, nullptr, r));
    return out;
}

}  // namespace flatep::transport
