#include "flatep/expert_pools.hpp"

#include <algorithm>
#include <atomic>
#include <string>
#include <tuple>
#include <utility>

#include "common/check.hpp"
#include "common/env.hpp"
#include "layout/invariants.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"
#include "runtime/backend.hpp"
#include "runtime/collective_guard.hpp"
#include "runtime/plan_data.hpp"
#include "runtime/serving_view.hpp"
#include "sync/sync.hpp"

namespace flatep {

namespace {

std::atomic<uint64_t> next_pools_id{1};

// Bytes of one expert's bf16 weights must be a multiple of this on both backends: prefetch moves them in 16-byte
// vectors on the GPU (and a layer's data must end 16-byte aligned at the end of its local memory).
constexpr int64_t kExpertByteMultiple = 16;

// Layout of the pools' sync region: barrier flags then status words (same shape as the Buffer's).
constexpr int64_t kFlagsOffset = 0;
constexpr int64_t kStatusOffset = int64_t(kMaxRanks) * 8;
constexpr int64_t kSyncBytes = kStatusOffset + 16;

}  // namespace

// ---- ExpertLayer ----

ExpertLayer::ExpertLayer(ExpertLayer&& other) noexcept
    : transport_(std::move(other.transport_)),
      projections_(std::move(other.projections_)),
      pools_id_(other.pools_id_),
      on_device_(other.on_device_) {
    other.projections_.clear();
    other.pools_id_ = 0;
    other.on_device_ = false;
}

ExpertLayer& ExpertLayer::operator=(ExpertLayer&& other) noexcept {
    if (this != &other) {
        reset();
        transport_ = std::move(other.transport_);
        projections_ = std::move(other.projections_);
        pools_id_ = other.pools_id_;
        on_device_ = other.on_device_;
        other.projections_.clear();
        other.pools_id_ = 0;
        other.on_device_ = false;
    }
    return *this;
}

ExpertLayer::~ExpertLayer() { reset(); }

void ExpertLayer::reset() noexcept {
    if (transport_ != nullptr) {
        for (Projection& p : projections_) {  // unmap_view / release_local skip what was never made
            transport_->unmap_view(p.weights_view);
            transport_->unmap_view(p.grads_view);
            transport_->release_local(p.weights_own);
            transport_->release_local(p.grads_own);
            transport_->release(p.weights_shared);
        }
    }
    projections_.clear();
    transport_.reset();
    on_device_ = false;
}

const ExpertLayer::Projection& ExpertLayer::projection(int p) const {
    FLATEP_CHECK(p >= 0 && p < num_projections(), "projection must be in [0, ", num_projections(), "), got ", p);
    return projections_[p];
}
uint16_t* ExpertLayer::weights(int p) const { return projection(p).weights; }
float* ExpertLayer::grads(int p) const { return projection(p).grads; }
uint16_t* ExpertLayer::own_weights(int p) const { return reinterpret_cast<uint16_t*>(projection(p).own); }
float* ExpertLayer::own_grads(int p) const {
    const Projection& pr = projection(p);
    if (pr.grads == nullptr) return nullptr;  // forward-only pools
    return reinterpret_cast<float*>(pr.grads_own.ptr + (reinterpret_cast<uint8_t*>(pr.grads) - pr.grads_view.base));
}

// ---- ExpertPools ----

ExpertPools::ExpertPools(std::shared_ptr<Transport> transport, int experts_per_rank,
                         std::vector<ProjectionShape> projections, int num_slots)
    : transport_(std::move(transport)),
      experts_per_rank_(experts_per_rank),
      projections_(std::move(projections)),
      id_(next_pools_id++),
      guard_(std::make_unique<CollectiveGuard>("ExpertPools")) {
    FLATEP_CHECK(transport_ != nullptr, "ExpertPools: transport is null");
    timeout_s_ = transport_->timeout_s();  // these pools' bound, whatever later objects set on the shared transport
    FLATEP_CHECK(experts_per_rank_ >= 1, "ExpertPools: experts_per_rank must be positive, got ", experts_per_rank_);
    FLATEP_CHECK(!projections_.empty(), "ExpertPools: at least one projection is needed");
    FLATEP_CHECK(num_slots == -1 || (num_slots >= 0 && num_slots <= experts_per_rank_),
                 "ExpertPools: num_slots must be -1 (epn) or in [0, epn=", experts_per_rank_, "], got ", num_slots);
    num_slots_ = num_slots == -1 ? experts_per_rank_ : num_slots;
    trains_ = !serving();
    for (size_t p = 0; p < projections_.size(); ++p) {
        const int eb = projections_[p].elem_bytes;
        FLATEP_CHECK(eb == 1 || eb == 2 || eb == 4, "ExpertPools: projection ", p,
                     " must have elem_bytes 1 (e4m3), 2 (bf16) or 4 (fp32), got ", eb);
        trains_ = trains_ && eb == 2;  // fp32 gradients of bf16 weights only
        FLATEP_CHECK(projections_[p].rows >= 1 && projections_[p].cols >= 1, "ExpertPools: projection ", p,
                     " must have positive rows and cols, got [", projections_[p].rows, "][", projections_[p].cols, "]");
        // The fp32 reduce pool is the largest allocation: epn*rows*cols*4 bytes must not overflow (limit 2^48).
        int64_t elems = 0, bytes = 0;
        const bool overflow = __builtin_mul_overflow(projections_[p].rows, projections_[p].cols, &elems) ||
                              __builtin_mul_overflow(elems, int64_t(experts_per_rank_) * 4, &bytes);
        FLATEP_CHECK(!overflow && bytes <= (int64_t(1) << 48), "ExpertPools: projection ", p, " of [",
                     projections_[p].rows, "][", projections_[p].cols, "] x ", experts_per_rank_,
                     " experts is too large");
        // One size contract for both backends (design §5): the kernels move experts in 16-byte vectors.
        FLATEP_CHECK(elems * eb % kExpertByteMultiple == 0, "ExpertPools: projection ", p, " of [",
                     projections_[p].rows, "][", projections_[p].cols, "] has ", elems * eb, " bytes per expert (",
                     eb == 1   ? "e4m3"
                     : eb == 2 ? "bf16"
                               : "fp32",
                     "), not a multiple of ", kExpertByteMultiple, "; rows * cols must be a multiple of ",
                     kExpertByteMultiple / eb);
    }
    view_stride_ = experts_per_rank_;
    if (serving()) {
        std::vector<int64_t> expert_bytes;
        for (const ProjectionShape& shape : projections_) expert_bytes.push_back(shape.expert_bytes());
        const int R = transport_->num_ranks();
        view_stride_ =
            int(runtime::serving_stride(R, experts_per_rank_, num_slots_, expert_bytes, transport_->granularity()));
        for (int64_t eb : expert_bytes) {
            bool fits = false;
            serving_.push_back(runtime::serving_geometry(R, experts_per_rank_, num_slots_, eb,
                                                         transport_->granularity(), view_stride_, &fits));
            FLATEP_CHECK_INVARIANT(
                "ExpertPools", serving_chunks_violation(R, experts_per_rank_, num_slots_, eb, transport_->granularity(),
                                                        view_stride_, serving_.back().offset.data(),
                                                        serving_.back().data_at.data(), serving_.back().own_bytes,
                                                        serving_.back().slot_bytes, serving_.back().view_bytes));
        }
    }
    backend_ = runtime::make_pools_backend(transport_, guard_.get());  // its device state on the transport's GPU
    num_sms_ = backend_->default_num_sms();
    auto release_all = [this] {
        for (SymmetricRegion& r : slot_regions_) transport_->release(r);
        for (SymmetricRegion& r : reduce_regions_) transport_->release(r);
        transport_->release(sync_region_);
    };
    try {
        sync_region_ = transport_->allocate(size_t(kSyncBytes));
        for (int p = 0; p < num_projections(); ++p) {
            const ProjectionShape& shape = projections_[p];
            const size_t slot_bytes = serving() ? serving_[p].slot_bytes : size_t(num_slots_ * shape.expert_bytes());
            slot_regions_.push_back(slot_bytes > 0 ? transport_->allocate(slot_bytes) : SymmetricRegion{});
            reduce_regions_.push_back(trains_ ? transport_->allocate(size_t(num_slots_ * shape.elems() * 4))
                                              : SymmetricRegion{});
        }
        backend_->watch_site(
            {transport_.get(), reinterpret_cast<const uint64_t*>(sync_region_.local + kFlagsOffset), &epoch_});
        // Every rank's zero fill of the new regions is complete before any rank's kernels write into them.
        backend_->synchronize();
        transport_->bootstrap().all_gather(std::string());
    } catch (...) {
        release_all();
        throw;
    }
}

ExpertPools::~ExpertPools() {
    guard_->set_site({});  // before the flags go
    backend_.reset();      // frees its device state on the transport's GPU (runtime/device_backend.cpp)
    for (SymmetricRegion& r : slot_regions_) transport_->release(r);
    for (SymmetricRegion& r : reduce_regions_) transport_->release(r);
    transport_->release(sync_region_);
}

const ProjectionShape& ExpertPools::shape(int p) const {
    FLATEP_CHECK(p >= 0 && p < num_projections(), "projection must be in [0, ", num_projections(), "), got ", p);
    return projections_[p];
}
uint16_t* ExpertPools::slot_pool(int p) const {
    shape(p);
    if (slot_regions_[p].local == nullptr) return nullptr;  // serving with B = 0
    const size_t at = serving() ? serving_[p].data_at[transport_->num_ranks()] : 0;
    return reinterpret_cast<uint16_t*>(slot_regions_[p].local + at);
}
float* ExpertPools::reduce_pool(int p) const {
    shape(p);
    return reinterpret_cast<float*>(reduce_regions_[p].local);
}

int64_t ExpertPools::view_rows() const {
    return serving() ? int64_t(transport_->num_ranks()) * view_stride_ + num_slots_ : 2 * int64_t(experts_per_rank_);
}

int64_t ExpertPools::view_row(int expert) const {
    const int E = transport_->num_ranks() * experts_per_rank_;
    FLATEP_CHECK(expert >= 0 && expert < E, "view_row: expert must be in [0, E=", E, "), got ", expert);
    FLATEP_CHECK(serving(), "view_row: the serving view's rows (num_slots < epn); these pools train (num_slots = epn)");
    return int64_t(home_rank(expert, experts_per_rank_)) * view_stride_ + local_expert(expert, experts_per_rank_);
}

void ExpertPools::check_trains(const char* op) const {
    FLATEP_CHECK(trains_, op, ": these pools are forward-only (",
                 serving() ? "serving: num_slots < epn" : "a projection's weights are not bf16",
                 "); gradients need num_slots = epn and bf16 weights");
}

// Serving: the own weights are symmetric memory (collective), the view maps every rank's chunk and this rank's slots.
ExpertLayer ExpertPools::register_serving_layer() {
    ExpertLayer layer;  // frees what was made when a later step throws
    layer.pools_id_ = id_;
    layer.on_device_ = backend_->on_device();
    layer.transport_ = transport_;
    const int R = transport_->num_ranks(), me = transport_->rank();
    for (int p = 0; p < num_projections(); ++p) {
        const runtime::ServingGeometry& geo = serving_[p];
        layer.projections_.emplace_back();
        ExpertLayer::Projection& pr = layer.projections_.back();
        pr.weights_shared = transport_->allocate(geo.own_bytes);
        std::vector<ViewPiece> pieces;
        for (int r = 0; r < R; ++r) {
            ViewPiece piece;
            piece.region_id = pr.weights_shared.id;
            piece.rank = r;
            piece.offset = geo.offset[r];
            pieces.push_back(piece);
        }
        if (num_slots_ > 0) {
            ViewPiece slots;
            slots.region_id = slot_regions_[p].id;
            slots.rank = me;
            slots.offset = geo.offset[R];
            pieces.push_back(slots);
        }
        // Between two chunks the view may have whole granules that no chunk maps (pad rows): one local granule is
        // mapped into each, so that every byte of the view is readable (a copy of the whole view works; pad rows hold
        // unspecified values and are empty groups of every plan).
        const size_t g = transport_->granularity();
        std::vector<std::pair<size_t, size_t>> used;  // [start, end) of the chunks
        for (int r = 0; r < R; ++r) used.emplace_back(geo.offset[r], geo.offset[r] + geo.own_bytes);
        if (num_slots_ > 0) used.emplace_back(geo.offset[R], geo.offset[R] + geo.slot_bytes);
        std::sort(used.begin(), used.end());
        used.emplace_back(geo.view_bytes, geo.view_bytes);  // and after the last chunk, up to the view's end
        size_t at = 0;
        for (const auto& [start, end] : used) {
            for (; at < start; at += g) {
                if (pr.weights_own.ptr == nullptr) pr.weights_own = transport_->allocate_local(g);
                ViewPiece pad;
                pad.local_id = pr.weights_own.id;
                pad.offset = at;
                pieces.push_back(pad);
            }
            at = std::max(at, end);
        }
        pr.weights_view = transport_->map_view(geo.view_bytes, pieces);
        pr.weights = reinterpret_cast<uint16_t*>(pr.weights_view.base);  // rank 0's data starts the view (row 0)
        pr.own = pr.weights_shared.local + geo.data_at[me];
    }
    return layer;
}

ExpertLayer ExpertPools::register_layer() {
    if (serving()) return register_serving_layer();
    ExpertLayer layer;  // frees what was made when a later step throws
    layer.pools_id_ = id_;
    layer.on_device_ = backend_->on_device();
    layer.transport_ = transport_;
    for (int p = 0; p < num_projections(); ++p) {
        layer.projections_.emplace_back();
        ExpertLayer::Projection& pr = layer.projections_.back();
        const int64_t elems = experts_per_rank_ * projections_[p].elems();
        const size_t weights_data = size_t(elems * projections_[p].elem_bytes), grads_data = size_t(elems * 4);
        // The layer's data ends where its local memory ends (a granularity boundary), so this rank's pool region,
        // mapped right after it, continues the view without a gap.
        for (auto [data_bytes, pool, own, view] :
             {std::tuple{weights_data, &slot_regions_[p], &pr.weights_own, &pr.weights_view},
              std::tuple{grads_data, &reduce_regions_[p], &pr.grads_own, &pr.grads_view}}) {
            if (pool->local == nullptr) continue;  // forward-only pools: no reduce pool, no grads
            *own = transport_->allocate_local(data_bytes);
            ViewPiece own_piece, pool_piece;
            own_piece.local_id = own->id;
            pool_piece.region_id = pool->id;
            pool_piece.rank = transport_->rank();
            pool_piece.offset = own->bytes;
            *view = transport_->map_view(own->bytes + pool->mapped_bytes, {own_piece, pool_piece});
            FLATEP_CHECK_INVARIANT(
                "register_layer",
                training_view_violation(experts_per_rank_, num_slots_, int64_t(data_bytes) / experts_per_rank_,
                                        data_bytes, own->bytes, pool->bytes, pool->mapped_bytes, view->bytes));
        }
        pr.weights = reinterpret_cast<uint16_t*>(pr.weights_view.base + (pr.weights_own.bytes - weights_data));
        pr.own = pr.weights_own.ptr + (pr.weights_own.bytes - weights_data);
        if (trains_) pr.grads = reinterpret_cast<float*>(pr.grads_view.base + (pr.grads_own.bytes - grads_data));
    }
    return layer;
}

bool ExpertPools::poisoned() const { return guard_->poisoned(); }
bool ExpertPools::on_device() const { return backend_->on_device(); }

void ExpertPools::set_num_sms(int num_sms) { num_sms_ = env::check_num_sms("ExpertPools", num_sms); }

Launch ExpertPools::enter(const Plan& plan, const ExpertLayer& layer, const char* op, const Launch& launch) const {
    Launch resolved = launch;
    resolved.num_sms = launch.num_sms == -1 ? num_sms_ : env::check_num_sms(op, launch.num_sms);
    guard_->enter(op, backend_->failure_message(), backend_->failure_code());
    FLATEP_CHECK(!plan.empty(), op, ": plan is empty (default-constructed); get one from Buffer::plan()");
    FLATEP_CHECK(plan.on_device() == backend_->on_device(), op, ": the pools are in ",
                 backend_->on_device() ? "device" : "host", " memory but the plan is in ",
                 plan.on_device() ? "device" : "host", " memory; use a plan from a Buffer over the same transport");
    plan.data().check_fresh(op);
    const Layout& l = plan.data().host.layout;  // the plan's shape: known on the host for device plans too
    FLATEP_CHECK_INVARIANT(op, slot_table_violation(l, plan.on_device() ? nullptr : plan.data().op_view().slot_expert));
    FLATEP_CHECK(l.num_ranks == transport_->num_ranks() && l.experts_per_rank == experts_per_rank_, op,
                 ": plan has R=", l.num_ranks, " epn=", l.experts_per_rank,
                 " but the pools have R=", transport_->num_ranks(), " epn=", experts_per_rank_);
    FLATEP_CHECK(l.num_slots == num_slots_ && (!serving() || l.view_stride == view_stride_), op,
                 ": plan has num_slots=", l.num_slots, " view_stride=", l.view_stride,
                 " but the pools have num_slots=", num_slots_, " view_stride=", view_stride_,
                 "; build the Buffer with the pools' num_slots and view_stride (ExpertPools::view_stride)");
    FLATEP_CHECK(plan.rank() == transport_->rank(), op, ": plan belongs to rank ", plan.rank(), ", pools to rank ",
                 transport_->rank());
    if (layer.pools_id() != id_) {
        FLATEP_THROW(ErrorCategory::kMismatch, op, ": layer was registered with pools ", layer.pools_id(),
                     ", not with these pools (", id_, ")");
    }
    return resolved;
}

namespace {
sync::SyncArgs pool_sync(const SymmetricRegion& region, uint64_t* epoch, int rank, int num_ranks, double timeout_s) {
    sync::SyncArgs s{};
    for (int p = 0; p < num_ranks; ++p) s.flags[p] = reinterpret_cast<uint64_t*>(region.peers[p] + kFlagsOffset);
    s.epoch = epoch;
    s.status = reinterpret_cast<int32_t*>(region.local + kStatusOffset);
    s.rank = rank;
    s.num_ranks = num_ranks;
    s.timeout_s = timeout_s;
    return s;
}
}  // namespace

void ExpertPools::prefetch(const Plan& plan, const ExpertLayer& layer, const Launch& launch, bool plan_ordered) {
    const Launch run = enter(plan, layer, "prefetch", launch);
    const int R = transport_->num_ranks();
    // Every projection in one op (one barrier for a pull, two for a push), kMaxPrefetchProjections at a time.
    for (int first = 0; first < num_projections(); first += kMaxPrefetchProjections) {
        PrefetchArgs args{};
        args.rank = transport_->rank();
        args.num_ranks = R;
        args.experts_per_rank = experts_per_rank_;
        args.num_slots = num_slots_;
        args.slot_expert = plan.data().op_view().slot_expert;  // [R][epn]
        args.pull = serving();
        args.plan_ordered = plan_ordered;
        args.num_projections = std::min(kMaxPrefetchProjections, num_projections() - first);
        for (int i = 0; i < args.num_projections; ++i) {
            const int p = first + i;
            PrefetchProjection& pp = args.projections[i];
            pp.expert_bytes = projections_[p].expert_bytes();
            if (args.pull) {
                const ExpertLayer::Projection& pr = layer.projection(p);
                for (int r = 0; r < R; ++r) pp.owners[r] = pr.weights_shared.peers[r] + serving_[p].data_at[r];
                pp.slot_pools[args.rank] = reinterpret_cast<uint8_t*>(slot_pool(p));
            } else {
                pp.weights = reinterpret_cast<const uint8_t*>(layer.own_weights(p));
                for (int d = 0; d < R; ++d) pp.slot_pools[d] = slot_regions_[p].peers[d];
            }
        }
        args.sync = pool_sync(sync_region_, &epoch_, args.rank, R, timeout_s_);
        args.sync.step = plan.generation();
        backend_->fill_sync(args.sync);
        check_prefetch_args(args);
        backend_->prefetch(args, run);
    }
}

void ExpertPools::reduce_grad(const Plan& plan, const ExpertLayer& layer, const Launch& launch) {
    const Launch run = enter(plan, layer, "reduce_grad", launch);
    check_trains("reduce_grad");
    const int R = transport_->num_ranks();
    for (int p = 0; p < num_projections(); ++p) {
        GradReduceArgs args{};
        args.rank = transport_->rank();
        args.num_ranks = R;
        args.experts_per_rank = experts_per_rank_;
        args.expert_elems = projections_[p].elems();
        args.slot_expert = plan.data().op_view().slot_expert;  // [R][epn]
        args.grads = layer.grads(p);
        for (int d = 0; d < R; ++d) args.reduce_pools[d] = reinterpret_cast<float*>(reduce_regions_[p].peers[d]);
        args.sync = pool_sync(sync_region_, &epoch_, args.rank, R, timeout_s_);
        args.sync.step = plan.generation();
        backend_->fill_sync(args.sync);
        check_grad_reduce_args(args);
        backend_->grad_reduce(args, run);
    }
}

void ExpertPools::write_grads(const Plan& plan, const ExpertLayer& layer, int projection, const void* grad,
                              int grad_bytes, bool accumulate, const Launch& launch) {
    const Launch run = enter(plan, layer, "write_grads", launch);
    check_trains("write_grads");
    FLATEP_CHECK(projection >= 0 && projection < num_projections(), "write_grads: projection must be in [0, ",
                 num_projections(), "), got ", projection);
    const int rank = transport_->rank();
    const PlanView& view = plan.data().op_view();
    WriteGradsArgs args{};
    args.experts_per_rank = experts_per_rank_;
    args.expert_elems = projections_[projection].elems();
    args.slot_expert = view.slot_expert + int64_t(rank) * experts_per_rank_;
    args.cu_seqlens = view.cu_seqlens + int64_t(rank) * plan.data().host.layout.num_groups();
    args.grad = grad;
    args.grad_bytes = grad_bytes;
    args.grads = layer.grads(projection);
    args.accumulate = accumulate;
    check_write_grads_args(args);
    backend_->write_grads(args, run);
}

}  // namespace flatep
