#include "flatep/expert_pools.hpp"

#include <algorithm>
#include <atomic>
#include <string>
#include <tuple>
#include <utility>

#include "common/check.hpp"
#include "common/env.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"
#include "runtime/backend.hpp"
#include "runtime/collective_guard.hpp"
#include "runtime/internal.hpp"
#include "runtime/launch.hpp"
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

// A layer's memory per projection and its views (include/flatep/expert_pools.hpp).
struct ExpertLayer::Impl {
    struct Projection {
        LocalMemory weights_own, grads_own;   // training: the layer's own memory; its data ends where the memory ends
                                              // (serving: weights_own is the granule mapped into the view's gaps)
        SymmetricRegion weights_shared;       // serving: the own weights, every rank's mapped (data at own_offset)
        MappedView weights_view, grads_view;  // the compute views
        uint16_t* weights = nullptr;          // start of the weights view's data
        float* grads = nullptr;
        uint8_t* own = nullptr;  // this rank's own experts [epn] (through their own mapping)
    };
    ~Impl() {  // unmap_view / release_local skip what was never made; never throws
        if (transport == nullptr) return;
        for (Projection& p : projections) {
            transport->unmap_view(p.weights_view);
            transport->unmap_view(p.grads_view);
            transport->release_local(p.weights_own);
            transport->release_local(p.grads_own);
            transport->release(p.weights_shared);
        }
    }
    const Projection& projection(int p) const {
        FLATEP_CHECK(p >= 0 && p < int(projections.size()), "projection must be in [0, ", projections.size(), "), got ",
                     p);
        return projections[p];
    }
    std::shared_ptr<Transport> transport;  // frees the memory and the views
    std::vector<Projection> projections;
    uint64_t pools_id = 0;
    bool on_device = false;
};

// An empty layer (default-constructed or moved from) has no Impl: no projection, pools id 0.
ExpertLayer::ExpertLayer() = default;
ExpertLayer::ExpertLayer(ExpertLayer&& other) noexcept = default;
ExpertLayer& ExpertLayer::operator=(ExpertLayer&& other) noexcept = default;
ExpertLayer::~ExpertLayer() = default;

namespace {
const ExpertLayer::Impl::Projection& projection_of(const std::unique_ptr<ExpertLayer::Impl>& impl, int p) {
    FLATEP_CHECK(impl != nullptr, "projection must be in [0, 0), got ", p);
    return impl->projection(p);
}
}  // namespace

int ExpertLayer::num_projections() const { return impl_ == nullptr ? 0 : int(impl_->projections.size()); }
uint64_t ExpertLayer::pools_id() const { return impl_ == nullptr ? 0 : impl_->pools_id; }
bool ExpertLayer::on_device() const { return impl_ != nullptr && impl_->on_device; }
uint16_t* ExpertLayer::weights(int p) const { return projection_of(impl_, p).weights; }
float* ExpertLayer::grads(int p) const { return projection_of(impl_, p).grads; }
uint16_t* ExpertLayer::own_weights(int p) const { return reinterpret_cast<uint16_t*>(projection_of(impl_, p).own); }
float* ExpertLayer::own_grads(int p) const {
    const Impl::Projection& pr = projection_of(impl_, p);
    if (pr.grads == nullptr) return nullptr;  // forward-only pools
    return reinterpret_cast<float*>(pr.grads_own.ptr + (reinterpret_cast<uint8_t*>(pr.grads) - pr.grads_view.base));
}

// ---- ExpertPools ----

// The pools' state and ops (include/flatep/expert_pools.hpp documents each); ExpertPools forwards to it.
struct ExpertPools::Impl {
    Impl(std::shared_ptr<Transport> transport, int experts_per_rank, std::vector<ProjectionShape> projections,
         int num_slots, int view_stride);
    ~Impl();  // releases the pools; never throws

    ExpertLayer register_layer();
    ExpertLayer register_serving_layer();
    void prefetch(const Plan& plan, const ExpertLayer& layer, const Launch& launch);
    void reduce_grad(const Plan& plan, const ExpertLayer& layer, const Launch& launch);
    void write_grads(const Plan& plan, const ExpertLayer& layer, int projection, const void* grad, int grad_bytes,
                     bool accumulate, const Launch& launch);
    bool serving() const { return num_slots_ < experts_per_rank_; }
    int num_projections() const { return int(projections_.size()); }
    int64_t view_rows() const;
    int64_t view_row(int expert) const;
    const ProjectionShape& shape(int projection) const;
    uint16_t* slot_pool(int projection) const;
    float* reduce_pool(int projection) const;
    bool on_device() const;
    bool poisoned() const;
    void set_num_sms(int num_sms);
    Launch enter(const Plan& plan, const ExpertLayer& layer, const char* op, const Launch& launch,
                 bool takes_plan_ordered = false) const;
    void check_trains(const char* op) const;

    std::vector<runtime::ServingGeometry> serving_;  // serving: per projection, where the view's chunks go

    std::shared_ptr<Transport> transport_;
    int experts_per_rank_;
    std::vector<ProjectionShape> projections_;
    std::vector<SymmetricRegion> slot_regions_, reduce_regions_;
    SymmetricRegion sync_region_;  // barrier flags + status words of the pool ops
    uint64_t epoch_ = 0;
    uint64_t id_;
    std::unique_ptr<CollectiveGuard> guard_;
    double timeout_s_ = 0;  // the transport's timeout when the pools were built: every op's waits
    int num_sms_ = 0;
    int num_slots_ = 0;
    int view_stride_ = 0;
    bool trains_ = false;
    std::unique_ptr<runtime::PoolsBackend> backend_;
};

ExpertLayer::ExpertLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ExpertPools::ExpertPools(std::shared_ptr<Transport> transport, int experts_per_rank,
                         std::vector<ProjectionShape> projections, int num_slots, int view_stride)
    : impl_(std::make_unique<Impl>(std::move(transport), experts_per_rank, std::move(projections), num_slots,
                                   view_stride)) {}
ExpertPools::~ExpertPools() = default;

ExpertLayer ExpertPools::register_layer() { return impl_->register_layer(); }
void ExpertPools::prefetch(const Plan& plan, const ExpertLayer& layer, const Launch& launch) {
    impl_->prefetch(plan, layer, launch);
}
void ExpertPools::reduce_grad(const Plan& plan, const ExpertLayer& layer, const Launch& launch) {
    impl_->reduce_grad(plan, layer, launch);
}
void ExpertPools::write_grads(const Plan& plan, const ExpertLayer& layer, int projection, const void* grad,
                              int grad_bytes, bool accumulate, const Launch& launch) {
    impl_->write_grads(plan, layer, projection, grad, grad_bytes, accumulate, launch);
}
int ExpertPools::experts_per_rank() const { return impl_->experts_per_rank_; }
int ExpertPools::num_slots() const { return impl_->num_slots_; }
bool ExpertPools::serving() const { return impl_->serving(); }
bool ExpertPools::trains() const { return impl_->trains_; }
int ExpertPools::view_stride() const { return impl_->view_stride_; }
int64_t ExpertPools::view_rows() const { return impl_->view_rows(); }
int64_t ExpertPools::view_row(int expert) const { return impl_->view_row(expert); }
int ExpertPools::num_projections() const { return impl_->num_projections(); }
const ProjectionShape& ExpertPools::shape(int projection) const { return impl_->shape(projection); }
uint16_t* ExpertPools::slot_pool(int projection) const { return impl_->slot_pool(projection); }
float* ExpertPools::reduce_pool(int projection) const { return impl_->reduce_pool(projection); }
uint64_t ExpertPools::id() const { return impl_->id_; }
bool ExpertPools::on_device() const { return impl_->on_device(); }
int ExpertPools::num_sms() const { return impl_->num_sms_; }
void ExpertPools::set_num_sms(int num_sms) { impl_->set_num_sms(num_sms); }
bool ExpertPools::poisoned() const { return impl_->poisoned(); }

namespace internal {
const std::shared_ptr<Transport>& transport(const ExpertPools& pools) { return pools.impl().transport_; }
}  // namespace internal

ExpertPools::Impl::Impl(std::shared_ptr<Transport> transport, int experts_per_rank,
                        std::vector<ProjectionShape> projections, int num_slots, int view_stride)
    : transport_(std::move(transport)),
      experts_per_rank_(experts_per_rank),
      projections_(std::move(projections)),
      id_(next_pools_id++),
      guard_(std::make_unique<CollectiveGuard>("ExpertPools")) {
    FLATEP_CHECK(transport_ != nullptr, "ExpertPools: transport is null");
    timeout_s_ = transport_->timeout_s();  // these pools' bound, whatever later objects set on the shared transport
    FLATEP_CHECK(experts_per_rank_ >= 1, "ExpertPools: experts_per_rank must be positive, got ", experts_per_rank_);
    FLATEP_CHECK(!projections_.empty(), "ExpertPools: at least one projection is needed");
    check_num_slots("ExpertPools: ", num_slots, experts_per_rank_);  // the one check of B
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
    FLATEP_CHECK(view_stride == 0 || serving(),
                 "ExpertPools: view_stride is for serving pools (num_slots < epn=", experts_per_rank_, "), got ",
                 view_stride);
    if (serving()) {
        std::vector<int64_t> expert_bytes;
        for (const ProjectionShape& shape : projections_) expert_bytes.push_back(shape.expert_bytes());
        const int R = transport_->num_ranks();
        const size_t g = transport_->granularity();
        const int smallest = int(runtime::serving_stride(R, experts_per_rank_, num_slots_, expert_bytes, g));
        // A larger stride than the smallest may be asked for: another transport's pools, whose plans must match.
        FLATEP_CHECK(view_stride == 0 || (view_stride >= smallest && view_stride <= kMaxViewStride),
                     "ExpertPools: view_stride must be 0 (the smallest that fits, ", smallest, ") or in [", smallest,
                     ", ", kMaxViewStride, "], got ", view_stride);
        view_stride_ = view_stride == 0 ? smallest : view_stride;
        for (size_t p = 0; p < expert_bytes.size(); ++p) {
            bool fits = false;
            serving_.push_back(
                runtime::serving_geometry(R, experts_per_rank_, num_slots_, expert_bytes[p], g, view_stride_, &fits));
            FLATEP_CHECK(fits, "ExpertPools: view_stride ", view_stride_, " does not fit projection ", p, " (",
                         expert_bytes[p], " bytes an expert) on this transport's ", g, "-byte granularity");
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

ExpertPools::Impl::~Impl() {
    guard_->set_site({});  // before the flags go
    backend_.reset();      // frees its device state on the transport's GPU (runtime/device_backend.cpp)
    for (SymmetricRegion& r : slot_regions_) transport_->release(r);
    for (SymmetricRegion& r : reduce_regions_) transport_->release(r);
    transport_->release(sync_region_);
}

const ProjectionShape& ExpertPools::Impl::shape(int p) const {
    FLATEP_CHECK(p >= 0 && p < num_projections(), "projection must be in [0, ", num_projections(), "), got ", p);
    return projections_[p];
}
uint16_t* ExpertPools::Impl::slot_pool(int p) const {
    shape(p);
    if (slot_regions_[p].local == nullptr) return nullptr;  // serving with B = 0
    const size_t at = serving() ? serving_[p].data_at[transport_->num_ranks()] : 0;
    return reinterpret_cast<uint16_t*>(slot_regions_[p].local + at);
}
float* ExpertPools::Impl::reduce_pool(int p) const {
    shape(p);
    return reinterpret_cast<float*>(reduce_regions_[p].local);
}

int64_t ExpertPools::Impl::view_rows() const {
    return serving() ? int64_t(transport_->num_ranks()) * view_stride_ + num_slots_ : 2 * int64_t(experts_per_rank_);
}

int64_t ExpertPools::Impl::view_row(int expert) const {
    const int E = transport_->num_ranks() * experts_per_rank_;
    FLATEP_CHECK(expert >= 0 && expert < E, "view_row: expert must be in [0, E=", E, "), got ", expert);
    FLATEP_CHECK(serving(), "view_row: the serving view's rows (num_slots < epn); these pools train (num_slots = epn)");
    return int64_t(home_rank(expert, experts_per_rank_)) * view_stride_ + local_expert(expert, experts_per_rank_);
}

void ExpertPools::Impl::check_trains(const char* op) const {
    FLATEP_CHECK(trains_, op, ": these pools are forward-only (",
                 serving() ? "serving: num_slots < epn" : "a projection's weights are not bf16",
                 "); gradients need num_slots = epn and bf16 weights");
}

// Serving: the own weights are symmetric memory (collective), the view maps every rank's chunk and this rank's slots.
ExpertLayer ExpertPools::Impl::register_serving_layer() {
    auto made = std::make_unique<ExpertLayer::Impl>();  // frees what was made when a later step throws
    ExpertLayer::Impl& layer = *made;
    layer.pools_id = id_;
    layer.on_device = backend_->on_device();
    layer.transport = transport_;
    const int R = transport_->num_ranks(), me = transport_->rank();
    for (int p = 0; p < num_projections(); ++p) {
        const runtime::ServingGeometry& geo = serving_[p];
        layer.projections.emplace_back();
        ExpertLayer::Impl::Projection& pr = layer.projections.back();
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
    return ExpertLayer(std::move(made));
}

ExpertLayer ExpertPools::Impl::register_layer() {
    if (serving()) return register_serving_layer();
    auto made = std::make_unique<ExpertLayer::Impl>();  // frees what was made when a later step throws
    ExpertLayer::Impl& layer = *made;
    layer.pools_id = id_;
    layer.on_device = backend_->on_device();
    layer.transport = transport_;
    for (int p = 0; p < num_projections(); ++p) {
        layer.projections.emplace_back();
        ExpertLayer::Impl::Projection& pr = layer.projections.back();
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
        }
        pr.weights = reinterpret_cast<uint16_t*>(pr.weights_view.base + (pr.weights_own.bytes - weights_data));
        pr.own = pr.weights_own.ptr + (pr.weights_own.bytes - weights_data);
        if (trains_) pr.grads = reinterpret_cast<float*>(pr.grads_view.base + (pr.grads_own.bytes - grads_data));
    }
    return ExpertLayer(std::move(made));
}

bool ExpertPools::Impl::poisoned() const { return guard_->poisoned(); }
bool ExpertPools::Impl::on_device() const { return backend_->on_device(); }

void ExpertPools::Impl::set_num_sms(int num_sms) { num_sms_ = env::check_num_sms("ExpertPools", num_sms); }

Launch ExpertPools::Impl::enter(const Plan& plan, const ExpertLayer& layer, const char* op, const Launch& launch,
                                bool takes_plan_ordered) const {
    const Launch resolved = runtime::resolve_launch(
        op, launch, num_sms_, takes_plan_ordered ? runtime::Takes::kPlanOrdered : runtime::Takes::kNoOption);
    guard_->enter(op, backend_->failure_message(), backend_->failure_code());
    FLATEP_CHECK(!plan.empty(), op, ": plan is empty (default-constructed); get one from Buffer::plan()");
    FLATEP_CHECK(plan.on_device() == backend_->on_device(), op, ": the pools are in ",
                 backend_->on_device() ? "device" : "host", " memory but the plan is in ",
                 plan.on_device() ? "device" : "host", " memory; use a plan from a Buffer over the same transport");
    plan.data().check_fresh(op);
    const Layout& l = plan.data().host.layout;  // the plan's shape: known on the host for device plans too
    FLATEP_CHECK(l.num_ranks == transport_->num_ranks() && l.experts_per_rank == experts_per_rank_, op,
                 ": plan has R=", l.num_ranks, " epn=", l.experts_per_rank,
                 " but the pools have R=", transport_->num_ranks(), " epn=", experts_per_rank_);
    FLATEP_CHECK(l.num_slots == num_slots_ && (!serving() || l.view_stride == view_stride_), op,
                 ": plan has num_slots=", l.num_slots, " view_stride=", l.view_stride,
                 " but the pools have num_slots=", num_slots_, " view_stride=", view_stride_,
                 "; build the Buffer from these pools (Buffer(config, pools))");
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

void ExpertPools::Impl::prefetch(const Plan& plan, const ExpertLayer& layer, const Launch& launch) {
    const Launch run = enter(plan, layer, "prefetch", launch, true);
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
        args.plan_ordered = run.options.plan_ordered;
        args.num_projections = std::min(kMaxPrefetchProjections, num_projections() - first);
        for (int i = 0; i < args.num_projections; ++i) {
            const int p = first + i;
            PrefetchProjection& pp = args.projections[i];
            pp.expert_bytes = projections_[p].expert_bytes();
            if (args.pull) {
                const ExpertLayer::Impl::Projection& pr = layer.impl().projection(p);
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

void ExpertPools::Impl::reduce_grad(const Plan& plan, const ExpertLayer& layer, const Launch& launch) {
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

void ExpertPools::Impl::write_grads(const Plan& plan, const ExpertLayer& layer, int projection, const void* grad,
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
