#include "transport/ipc_transport.hpp"

#include <unistd.h>

#include <cstring>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"
#include "flatep/ipc.hpp"
#if defined(FLATEP_IPC_CUDA)
#include "transport/cuda/ipc_cuda_memory.hpp"
#endif

namespace flatep::transport {

namespace {

constexpr uint32_t kAnnounceMagic = 0x41455046u;  // "FPEA"
constexpr size_t kNonceChars = 32;                // 16 random bytes as hex

// What each rank tells the others through the bootstrap before any socket exists.
struct Announce {
    uint32_t magic;
    int32_t kind;
    int32_t pid;
    uint32_t uid;
    char nonce[kNonceChars];
};

struct AllocateMessage {
    uint64_t bytes;
    uint64_t mapped_bytes;
};

}  // namespace

IpcTransport::IpcTransport(std::shared_ptr<Bootstrap> bootstrap, std::unique_ptr<IpcMemory> memory,
                           const IpcOptions& options)
    : bootstrap_(std::move(bootstrap)), memory_(std::move(memory)) {
    FLATEP_CHECK(bootstrap_ != nullptr, "ipc transport: bootstrap is null");
    FLATEP_CHECK(memory_ != nullptr, "ipc transport: memory is null");
    timeout_s_ = env::resolve_timeout("ipc transport", options.timeout_s);
    rank_ = bootstrap_->rank();
    num_ranks_ = bootstrap_->size();
    FLATEP_CHECK(num_ranks_ >= 1 && num_ranks_ <= kMaxRanks, "ipc transport: num_ranks must be in [1, ", kMaxRanks,
                 "], got ", num_ranks_);
    views_ = std::make_unique<MemoryViews>(*memory_, num_ranks_);

    // 1. Announce pid, uid, memory kind and a nonce; rank 0's nonce names the job's sockets.
    Announce mine{};
    mine.magic = kAnnounceMagic;
    mine.kind = static_cast<int32_t>(memory_->kind());
    mine.pid = static_cast<int32_t>(::getpid());
    mine.uid = static_cast<uint32_t>(::getuid());
    const std::string nonce = ipc::random_hex(kNonceChars / 2);
    std::memcpy(mine.nonce, nonce.data(), kNonceChars);
    const std::vector<std::string> all =
        bootstrap_->all_gather(std::string(reinterpret_cast<char*>(&mine), sizeof(mine)));
    FLATEP_CHECK_RUNTIME(static_cast<int>(all.size()) == num_ranks_, "ipc transport: bootstrap returned ", all.size(),
                         " blobs for ", num_ranks_, " ranks");
    std::vector<Announce> announced(num_ranks_);
    pids_.assign(num_ranks_, 0);
    for (int r = 0; r < num_ranks_; ++r) {
        FLATEP_CHECK_RUNTIME(all[r].size() == sizeof(Announce), "ipc transport: rank ", r, " announced ", all[r].size(),
                             " bytes, expected ", sizeof(Announce));
        std::memcpy(&announced[r], all[r].data(), sizeof(Announce));
        FLATEP_CHECK_RUNTIME(announced[r].magic == kAnnounceMagic, "ipc transport: rank ", r,
                             " sent a malformed announcement");
        if (announced[r].kind != mine.kind)
            FLATEP_THROW(ErrorCategory::kMismatch, "ipc transport: rank ", r, " uses memory kind ", announced[r].kind,
                         ", rank ", rank_, " uses ", mine.kind, " (0 host, 1 device)");
        pids_[r] = announced[r].pid;
    }
    for (int r = 0; r < num_ranks_; ++r)
        if (r != rank_ && pids_[r] == pids_[rank_] && !options.same_process)
            FLATEP_THROW(ErrorCategory::kInvalidArgument, "ipc transport: ranks ", r, " and ", rank_,
                         " are the same process (pid ", pids_[r], "); use the local transport for threads");
    if (num_ranks_ == 1) return;

    // 2. Listen, barrier, build the mesh (SO_PEERCRED against the announced pids and uid).
    ipc::MeshSpec spec;
    spec.name_prefix = "flatep-" + std::string(announced[0].nonce, kNonceChars);
    spec.token = spec.name_prefix;
    spec.rank = rank_;
    spec.size = num_ranks_;
    spec.expected_pids = pids_;
    spec.timeout_s = timeout_s_;
    spec.what = detail::concat("ipc transport (rank ", rank_, ")");
    ipc::Fd listener = ipc::listen_abstract(ipc::mesh_socket_name(spec, rank_), 128);
    if (options.on_listening) options.on_listening(ipc::mesh_socket_name(spec, rank_));
    bootstrap_->all_gather(std::string());
    sockets_ = ipc::build_mesh(spec, listener.get(), &num_refused_);
    listener.reset();  // the name disappears: nobody can connect any more
    for (const ipc::Fd& fd : sockets_) raw_sockets_.push_back(fd.get());
}

IpcTransport::~IpcTransport() {
    for (auto& [id, allocation] : allocations_) free_allocation(allocation);
    allocations_.clear();
}

std::string IpcTransport::name_peer(int rank) const {
    return detail::concat("rank ", rank, " (pid ", pids_[rank], ")");
}

void IpcTransport::free_allocation(Allocation& allocation) noexcept {
    for (int p = 0; p < static_cast<int>(allocation.peers.size()); ++p)
        if (p != rank_ && allocation.peers[p].ptr != nullptr) memory_->unmap_peer(allocation.peers[p]);
    allocation.peers.clear();
    memory_->destroy(allocation.local);
}

MappedView IpcTransport::map_view(size_t bytes, const std::vector<ViewPiece>& pieces) {
    return views_->map_view(bytes, pieces, [this](int region_id, int rank) -> const IpcMapping* {
        const auto it = allocations_.find(region_id);
        if (it == allocations_.end()) return nullptr;
        return rank == rank_ ? &it->second.local : &it->second.peers[rank];
    });
}

SymmetricRegion IpcTransport::allocate(size_t bytes) {
    FLATEP_CHECK(bytes > 0, "ipc allocate: bytes must be > 0, got ", bytes);
    const size_t granularity = memory_->granularity();
    const size_t mapped_bytes = (bytes + granularity - 1) / granularity * granularity;
    const int id = ++num_allocations_;

    Allocation allocation;
    allocation.mapped_bytes = mapped_bytes;
    allocation.peers.assign(num_ranks_, IpcMapping{});
    allocation.local = memory_->create(mapped_bytes, /*exported=*/true);
    try {
        if (num_ranks_ > 1) {
            const AllocateMessage request{bytes, mapped_bytes};
            std::vector<ipc::Message> out(num_ranks_);
            for (int p = 0; p < num_ranks_; ++p) {
                if (p == rank_) continue;
                out[p].payload.assign(reinterpret_cast<const char*>(&request), sizeof(request));
                out[p].fd = allocation.local.fd;
            }
            std::vector<ipc::Message> in =
                ipc::exchange(raw_sockets_, rank_, out, static_cast<uint32_t>(id), timeout_s_,
                              detail::concat("ipc allocate #", id, " (", bytes, " bytes) on rank ", rank_),
                              [this](int peer) { return name_peer(peer); });
            std::vector<ipc::Fd> received(num_ranks_);
            for (int p = 0; p < num_ranks_; ++p) received[p].reset(in[p].fd);
            for (int p = 0; p < num_ranks_; ++p) {
                if (p == rank_) continue;
                AllocateMessage reply{};
                FLATEP_CHECK_RUNTIME(in[p].payload.size() == sizeof(reply), "ipc allocate #", id, ": ", name_peer(p),
                                     " sent a malformed message");
                std::memcpy(&reply, in[p].payload.data(), sizeof(reply));
                if (reply.bytes != bytes || reply.mapped_bytes != mapped_bytes)
                    FLATEP_THROW(ErrorCategory::kMismatch, "ipc allocate #", id, ": ", name_peer(p), " allocates ",
                                 reply.bytes, " bytes (mapped ", reply.mapped_bytes, "), rank ", rank_, " allocates ",
                                 bytes, " (mapped ", mapped_bytes, ")");
                FLATEP_CHECK_RUNTIME(received[p].valid(), "ipc allocate #", id, ": ", name_peer(p),
                                     " sent no descriptor");
            }
            for (int p = 0; p < num_ranks_; ++p)
                if (p != rank_) allocation.peers[p] = memory_->map_peer(received[p].get(), mapped_bytes);
        }
    } catch (...) {
        free_allocation(allocation);
        throw;
    }
    if (memory_->kind() == MemoryKind::kDevice) {  // the handle maps it again; the exported fd is no longer needed
        ipc::close_quietly(allocation.local.fd);
        allocation.local.fd = -1;
    }

    SymmetricRegion region;
    region.bytes = bytes;
    region.mapped_bytes = mapped_bytes;
    region.local = allocation.local.ptr;
    for (int p = 0; p < num_ranks_; ++p) region.peers[p] = p == rank_ ? allocation.local.ptr : allocation.peers[p].ptr;
    region.local_fd = allocation.local.fd;
    region.local_handle = allocation.local.handle;
    region.id = id;
    allocations_.emplace(id, std::move(allocation));
    return region;
}

void IpcTransport::release(SymmetricRegion& region) noexcept {
    if (region.id < 0 && region.local == nullptr) return;  // never allocated, or already released
    auto it = allocations_.find(region.id);
    if (it == allocations_.end() || it->second.local.ptr != region.local) {
        FLATEP_LOG_WARN("ipc release: region id ", region.id, " is not a live region of this transport (rank ", rank_,
                        "); ignored");
        return;
    }
    free_allocation(it->second);
    allocations_.erase(it);
    region = SymmetricRegion{};
}

}  // namespace flatep::transport

namespace flatep {

std::unique_ptr<Transport> make_ipc_transport(std::shared_ptr<Bootstrap> bootstrap, MemoryKind kind, double timeout_s,
                                              bool same_process, int device) {
    transport::IpcOptions options;
    options.timeout_s = timeout_s;
    options.same_process = same_process;
    std::unique_ptr<transport::IpcMemory> memory;
    FLATEP_CHECK(device >= -1, "ipc transport: device must be a CUDA device ordinal or -1, got ", device);
    if (kind == MemoryKind::kHost) {
        memory = transport::make_host_ipc_memory();
    } else {
#if defined(FLATEP_IPC_CUDA)
        memory = transport::make_cuda_ipc_memory(device);
#else
        FLATEP_THROW(ErrorCategory::kInvalidArgument,
                     "ipc transport: MemoryKind::kDevice needs a FlatEP build with CUDA (this one has none)");
#endif
    }
    return std::make_unique<transport::IpcTransport>(std::move(bootstrap), std::move(memory), options);
}

}  // namespace flatep
