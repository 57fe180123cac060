// flatep::ExpertPools: the expert weights side of FlatEP (design §5). Once per process it allocates, per
// projection, a slot pool (bf16 [epn][rows][cols], where replicas land) and a reduce pool (fp32, same shape, where
// replicas' gradients are computed) in symmetric memory, shared by all layers. Each layer registers once and gets
// its own expert weights and gradients plus the compute views:
//   weights(p): bf16 [2*epn][rows][cols] = the layer's own experts [0, epn) followed by the slot pool [epn, 2*epn)
//   grads(p):   fp32 [2*epn][rows][cols] = the layer's own gradients followed by the reduce pool
// each one contiguous virtual range (memfd mappings placed back to back), so an unmodified grouped GEMM over
// group g of Plan::cu_seqlens(rank) reads the right expert for both local groups and replica slots.
// The memory and the views come from the transport (Transport::allocate_local / map_view): over a device-memory
// transport (ipc with MemoryKind::kDevice) the same holds in device memory (CUDA VMM allocations mapped back to back
// in one reserved VA range), and prefetch / reduce_grad are kernels enqueued on stream() (device plans only; no host
// synchronisation). Pools and layers may be built and dropped on any thread: the transport binds its own device.
//
//   flatep::ExpertPools pools(transport, epn, {{H, Hp}, {Hp, H}});   // collective
//   flatep::ExpertLayer layer = pools.register_layer();              // collective
//   pools.prefetch(plan, layer);     // forward, before the GEMM: replicas' weights into the slot pools
//   pools.write_grads(plan, layer, p, grad, 2);  // backward, per projection: the GEMM's bf16 grads into grads(p)
//   pools.reduce_grad(plan, layer);  // backward, after the GEMM: replicas' grads into the owners', slots zeroed
//
// The slot and reduce pools are shared by every layer: prefetch a layer's replicas right before computing it
// (again in backward), and reduce its gradients before the next layer writes the reduce pool.
//
// Serving (num_slots B < epn; design §5 "Serving layout"): each rank keeps only B slots and the layer's own weights
// are symmetric memory every rank maps. weights(p) is one view [view_rows][rows][cols], laid out the same on every
// rank: rank r's own experts at rows [r*Q, r*Q + epn) (Q = view_stride() >= epn: the mapping granularity may force
// Q - epn empty pad rows between the ranks' chunks), then this rank's B slots at rows [R*Q, R*Q + B). A replica
// beyond the B slots is computed straight from its home rank's memory through the view (the plan's group of view row
// home*Q + local), and prefetch is a pull: each rank copies its slotted experts from their owners' memory into its
// own slots (one barrier, or none with prefetch's options.plan_ordered). Serving pools are forward-only (no reduce
// pools; reduce_grad / write_grads refuse), and register_layer is collective there. Projections of 1-byte (e4m3) or
// 4-byte (e.g. fp32 block scales) elements move as bytes with the rest; pools with such a projection are forward-only
// too.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "flatep/buffer.hpp"
#include "flatep/transport.hpp"

namespace flatep {

struct ProjectionShape {
    int64_t rows = 0;  // per expert: weights [rows][cols] (fp32 grads [rows][cols] for bf16 weights in training)
    int64_t cols = 0;
    int elem_bytes = 2;  // bytes of one weight: 2 (bf16, the default), 1 (e4m3) or 4 (fp32, e.g. block scales)
    int64_t elems() const { return rows * cols; }
    int64_t expert_bytes() const { return elems() * elem_bytes; }
};

// One layer's expert memory (per projection: own weights and own grads, each the transport's local memory) and its
// compute views. Move-only; unmaps everything on destruction (never throws).
class ExpertLayer {
  public:
    ExpertLayer();
    ExpertLayer(ExpertLayer&& other) noexcept;
    ExpertLayer& operator=(ExpertLayer&& other) noexcept;
    ~ExpertLayer();

    int num_projections() const;
    // Compute views: [2*epn][rows][cols] in training, [view_rows][rows][cols] in serving (ExpertPools's comment);
    // elements of the projection's elem_bytes. grads(p) is null for forward-only pools.
    uint16_t* weights(int projection) const;
    float* grads(int projection) const;
    // The layer's own memory [epn][rows][cols] through its own mapping (aliases weights(p)'s first epn experts).
    // Device memory (on_device()) for device-memory transports.
    uint16_t* own_weights(int projection) const;
    float* own_grads(int projection) const;
    uint64_t pools_id() const;
    bool on_device() const;

    // The implementation (src/runtime): opaque outside the library (only ExpertPools makes one).
    struct Impl;
    explicit ExpertLayer(std::unique_ptr<Impl> impl);
    Impl& impl() const { return *impl_; }

  private:
    std::unique_ptr<Impl> impl_;
};

class ExpertPools {
  public:
    using Layer = ExpertLayer;

    // Collective over the transport's ranks. experts_per_rank: epn = E / R of the Buffers the plans come from.
    // num_slots: B in [0, epn] replica slots per rank, or -1 for epn (training). The pools own B and the view stride
    // Q: a Buffer whose plans serving pools take is made from them (Buffer(config, pools)) and takes both.
    // view_stride (serving only): 0, the smallest stride the transport's mapping granularity allows, or a larger one
    // that fits every projection (pools over another transport whose plans must have the same groups).
    ExpertPools(std::shared_ptr<Transport> transport, int experts_per_rank, std::vector<ProjectionShape> projections,
                int num_slots = -1, int view_stride = 0);
    ~ExpertPools();  // releases the pools; never throws
    ExpertPools(const ExpertPools&) = delete;
    ExpertPools& operator=(const ExpertPools&) = delete;

    // Creates a layer's zero-filled weights (and grads) and maps its compute views. Training: local (not
    // collective); serving: collective (the own weights are symmetric memory).
    ExpertLayer register_layer();

    // Collective. Training: owners push this step's replicas (plan.slot_expert) of every projection into the slot
    // pools (two barriers). Serving: each rank pulls its B slotted experts from their owners (one barrier).
    // launch.options.plan_ordered (serving only; a push refuses it): the pull takes no barrier of its own. The plan op
    // that made `plan` met every rank after its last write of its own weights, so the owners' weights are final
    // already; the caller promises that no rank writes its layer's weights from that plan op until the next Buffer op
    // after this prefetch (a step's combine): write them between steps. Every rank must pass the same plan_ordered.
    // flatep.nn.MoE's serving layers use it: their forward runs plan, dispatch, prefetch and combine in one call.
    void prefetch(const Plan& plan, const ExpertLayer& layer, const Launch& launch = {});
    // Collective: owners add the replicas' fp32 grads (reduce pools) into the layer's own grads in ascending
    // (rank, slot) order; then every rank zeroes its consumed slots.
    void reduce_grad(const Plan& plan, const ExpertLayer& layer, const Launch& launch = {});
    // Local (not collective), before reduce_grad: writes one projection's weight gradients as a grouped GEMM over the
    // compute view computes them, grad [2*epn][rows][cols] (bf16: grad_bytes 2, or fp32: 4; group g < epn own expert
    // g, group epn + j slot j), into layer.grads(projection) in the state reduce_grad expects: own groups always
    // (converted exactly to fp32; zero for a group without rows this step, whatever grad holds there), slot groups
    // only when the slot is used this step (plan.slot_expert(rank)[j] >= 0) and has rows; other slots are not
    // touched (their reduce pool stays zero, as reduce_grad left it). accumulate: own groups with rows are added
    // into the own grads (fp32, one add per element) and own groups without rows are not touched, so the own grads
    // accumulate over micro-batches until the caller zeroes them (Megatron's main_grad); slot groups as above.
    // Device pools: enqueued on the launch's stream.
    void write_grads(const Plan& plan, const ExpertLayer& layer, int projection, const void* grad, int grad_bytes,
                     bool accumulate = false, const Launch& launch = {});

    // The bytes that a prefetch with a static plan (PlannerKind::kStatic) copies into the slots of `rank` (-1: of every
    // rank, summed): its placed slots times one expert's bytes over all projections. Local, no synchronisation (the
    // placement is known on the host). What moving a placement costs once: a static placement's later plans need no
    // prefetch while the slots still hold it (prefetch moves the same bytes again whenever it is called).
    int64_t placement_bytes(const Plan& plan, int rank) const;

    int experts_per_rank() const;
    int num_slots() const;    // B
    bool serving() const;     // B < epn
    bool trains() const;      // reduce_grad / write_grads available (training, bf16 weights)
    int view_stride() const;  // Q: view rows per rank (serving; epn in training)
    // Rows of the weights view: R*Q + B in serving, 2*epn in training.
    int64_t view_rows() const;
    // The view row of expert e's own weights in serving (home(e)*Q + local(e)).
    int64_t view_row(int expert) const;
    int num_projections() const;
    const ProjectionShape& shape(int projection) const;
    // This rank's pools [B][rows][cols] (what the views map after the own experts); reduce_pool is null when the
    // pools do not train.
    uint16_t* slot_pool(int projection) const;
    float* reduce_pool(int projection) const;
    uint64_t id() const;

    // Device pools (a transport with MemoryKind::kDevice): every op is enqueued on its Launch's CUDA stream (see
    // flatep/launch.hpp) and never synchronises with the host. The plan must be a device plan whose producing ops were
    // ordered before on that stream, and the layer's views are read / written by the kernels in stream order.
    bool on_device() const;
    // The SM budget of calls whose Launch says -1 (see Buffer::num_sms); starts at FLATEP_NUM_SMS.
    int num_sms() const;
    void set_num_sms(int num_sms);

    // True after a failed cross-rank wait of a pools op (timeout, ranks in different ops or steps, a peer that gave
    // up): every later op throws kRuntime until the pools are rebuilt on every rank (see flatep/buffer.hpp).
    bool poisoned() const;

    // The implementation (src/runtime): opaque outside the library.
    struct Impl;
    Impl& impl() const { return *impl_; }

  private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace flatep
