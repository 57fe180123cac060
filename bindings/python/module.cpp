// flatep._C: the pybind11 binding of FlatEP's torch-free C++ API (the only file that includes Python headers).
//
// Tensors never cross as tensors: the Python layer (python/flatep) validates every tensor (dtype, shape, device,
// contiguity) and passes its data pointer as an int; 0 means null. Nothing here links against libtorch, so one build
// serves any torch version. flatep::Error becomes ValueError (invalid argument, mismatch) or RuntimeError (runtime,
// timeout) carrying the error's one-line message.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "flatep/ffn.hpp"
#include "flatep/flatep.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"

namespace py = pybind11;

namespace flatep {
namespace {

template <class T>
T* as_ptr(uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

// The text of a Python exception on one line (pybind11's what() appends the traceback).
std::string one_line(const py::error_already_set& e) {
    std::string text = py::str(e.value());
    for (char& c : text)
        if (c == '\n' || c == '\r') c = ' ';
    return text;
}

// Python subclasses of flatep._C.Bootstrap (torch.distributed in python/flatep/distributed.py) implement rank(),
// size() and all_gather(bytes) -> list[bytes]. A Python exception inside all_gather becomes a flatep::Error so that
// the library only ever unwinds through its own exception type, its message on one line: a TimeoutError (how the
// package's bootstraps report a peer that did not arrive or left) becomes kTimeout with its message as it is, any
// other exception kRuntime naming its type.
class PyBootstrap : public Bootstrap {
  public:
    int rank() const override { PYBIND11_OVERRIDE_PURE(int, Bootstrap, rank, ); }
    int size() const override { PYBIND11_OVERRIDE_PURE(int, Bootstrap, size, ); }
    std::vector<std::string> all_gather(const std::string& blob) override {
        py::gil_scoped_acquire gil;
        py::function override = py::get_override(static_cast<const Bootstrap*>(this), "all_gather");
        FLATEP_CHECK_RUNTIME(static_cast<bool>(override), "Bootstrap subclass does not implement all_gather");
        std::vector<std::string> blobs;
        try {
            py::object result = override(py::bytes(blob));
            for (py::handle item : result) blobs.push_back(item.cast<std::string>());
        } catch (py::error_already_set& e) {
            if (e.matches(PyExc_TimeoutError)) FLATEP_THROW(ErrorCategory::kTimeout, one_line(e));
            FLATEP_THROW(ErrorCategory::kRuntime, "Bootstrap.all_gather raised ",
                         py::str(e.type().attr("__name__")).cast<std::string>(), ": ", one_line(e));
        } catch (py::cast_error& e) {
            FLATEP_THROW(ErrorCategory::kRuntime, "Bootstrap.all_gather must return a list of bytes: ", e.what());
        }
        return blobs;
    }
};

// A shared_ptr to the C++ side of a Python Bootstrap that also owns a reference to the Python object, so the
// override stays reachable for as long as a transport holds the bootstrap.
std::shared_ptr<Bootstrap> keep_python_alive(const py::object& bootstrap) {
    auto inner = bootstrap.cast<std::shared_ptr<Bootstrap>>();
    auto* keep = new py::object(bootstrap);
    Bootstrap* raw = inner.get();
    return std::shared_ptr<Bootstrap>(raw, [inner, keep](Bootstrap*) mutable {
        if (Py_IsInitialized()) {
            py::gil_scoped_acquire gil;
            delete keep;
        }  // else: the interpreter is gone; leak the reference rather than touch it
        inner.reset();
    });
}

py::array_t<int32_t> to_array(std::span<const int32_t> values, std::vector<py::ssize_t> shape) {
    py::array_t<int32_t> array(shape);
    std::copy(values.begin(), values.end(), array.mutable_data());
    return array;
}

py::list to_list(const int32_t* values, int n) {
    py::list list;
    for (int i = 0; i < n; ++i) list.append(values[i]);
    return list;
}

py::dict stats_dict(const Plan& plan) {
    const PlanStats& s = plan.stats();
    const int R = internal::layout(plan).num_ranks;
    py::dict d;
    d["entries_total"] = s.entries_total;
    d["entries_moved"] = s.entries_moved;
    d["entries_on_source"] = s.entries_on_source;
    d["max_load_before"] = s.max_load_before;
    d["max_load_after"] = s.max_load_after;
    d["min_load_after"] = s.min_load_after;
    d["replicas"] = s.total_replicas;
    d["P"] = s.makespan;
    d["max_replicas_in"] = s.max_replicas_in;
    d["max_replicas_out"] = s.max_replicas_out;
    d["loads_before"] = to_list(s.loads_before, R);
    d["loads"] = to_list(s.loads_after, R);
    d["replicas_in"] = to_list(s.replicas_in, R);
    d["replicas_out"] = to_list(s.replicas_out, R);
    return d;
}

void bind_errors(py::module_& m) {
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const Error& e) {
            const bool value =
                e.category() == ErrorCategory::kInvalidArgument || e.category() == ErrorCategory::kMismatch;
            PyErr_SetString(value ? PyExc_ValueError : PyExc_RuntimeError, e.message().c_str());
        }
    });
}

void bind_transport(py::module_& m) {
    py::class_<Bootstrap, PyBootstrap, std::shared_ptr<Bootstrap>>(m, "Bootstrap",
                                                                   "Small-blob all-gather of one process per rank. "
                                                                   "Subclass it: rank(), size(), all_gather(bytes) "
                                                                   "-> list[bytes] indexed by rank.")
        .def(py::init<>())
        .def("rank", &Bootstrap::rank)
        .def("size", &Bootstrap::size)
        .def(
            "all_gather",
            [](Bootstrap& b, const py::bytes& blob) {
                std::vector<std::string> blobs = b.all_gather(std::string(blob));
                py::list out;
                for (const std::string& s : blobs) out.append(py::bytes(s));
                return out;
            },
            py::arg("blob"));

    py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport")
        .def_property_readonly("rank", &Transport::rank)
        .def_property_readonly("num_ranks", &Transport::num_ranks)
        .def_property_readonly("name", &Transport::name)
        .def_property_readonly(
            "memory_kind", [](const Transport& t) { return t.memory_kind() == MemoryKind::kHost ? "host" : "device"; })
        .def_property_readonly("device", &Transport::device, "CUDA device ordinal of the memory; -1 for host memory")
        .def_property_readonly("granularity", &Transport::granularity,
                               "unit of region sizes, local memory sizes and view offsets (bytes)")
        .def_property("timeout_s", &Transport::timeout_s, [](Transport& t, double seconds) {
            t.set_timeout_s(env::check_timeout("Transport", "timeout_s", seconds));
        });
    m.def("env_timeout_s", &env::timeout_seconds,
          "FLATEP_TIMEOUT_S in seconds (default 100): the timeout of every wait that is not given one. A value outside "
          "(0, 86400] raises ValueError naming it.");

    m.def(
        "make_ipc_transport",
        [](const py::object& bootstrap, const std::string& memory, double timeout_s, bool same_process, int device) {
            FLATEP_CHECK(memory == "host" || memory == "device", "memory must be 'host' or 'device', got '", memory,
                         "'");
            std::shared_ptr<Bootstrap> boot = keep_python_alive(bootstrap);
            const MemoryKind kind = memory == "host" ? MemoryKind::kHost : MemoryKind::kDevice;
            py::gil_scoped_release release;  // the bootstrap's all_gather takes the GIL back
            return std::shared_ptr<Transport>(
                make_ipc_transport(std::move(boot), kind, timeout_s, same_process, device));
        },
        py::arg("bootstrap"), py::arg("memory") = "host", py::arg("timeout_s") = 0.0, py::arg("same_process") = false,
        py::arg("device") = -1,
        "Collective over the bootstrap's ranks: the multi-process `ipc` transport (memfd regions for 'host'; CUDA VMM "
        "regions on CUDA device `device` for 'device', -1: the current context's device). same_process=True lets the "
        "ranks be threads of one process (flatep.virtual). timeout_s: seconds in (0, 86400], 0 (the default): "
        "FLATEP_TIMEOUT_S; anything else raises ValueError before any collective.");
}

void bind_plan(py::module_& m) {
    py::class_<Plan>(m, "Plan", "One step's plan (C++ flatep::Plan). Arrays are returned as numpy copies.")
        .def_property_readonly("empty", &Plan::empty)
        .def_property_readonly("generation", &Plan::generation)
        .def_property_readonly("buffer_id", &Plan::buffer_id)
        .def_property_readonly("rank", &Plan::rank)
        .def_property_readonly("num_tokens", &Plan::num_tokens)
        .def_property_readonly("planner", [](const Plan& p) { return std::string(planner_name(p.planner())); })
        .def_property_readonly("placement_epoch", &Plan::placement_epoch)
        .def(
            "slot_expert",
            [](const Plan& p, int rank) {
                return to_array(p.slot_expert(rank), {py::ssize_t(p.slot_expert(rank).size())});
            },
            py::arg("rank"))
        .def(
            "cu_seqlens",
            [](const Plan& p, int rank) {
                return to_array(p.cu_seqlens(rank), {py::ssize_t(p.cu_seqlens(rank).size())});
            },
            py::arg("rank"))
        .def("tpe_all",
             [](const Plan& p) {
                 const Layout& l = internal::layout(p);
                 return to_array(p.tpe_all(), {l.num_ranks, l.num_experts});
             })
        .def("alloc",
             [](const Plan& p) {
                 const Layout& l = internal::layout(p);
                 return to_array(p.alloc(), {l.num_ranks, l.num_experts});
             })
        .def("entry_ranks",
             [](const Plan& p) {
                 return to_array(p.entry_ranks(), {p.num_tokens(), internal::layout(p).topk});
             })
        .def("entry_rows",
             [](const Plan& p) {
                 return to_array(p.entry_rows(), {p.num_tokens(), internal::layout(p).topk});
             })
        .def("row_heads", [](const Plan& p) { return to_array(p.row_heads(), {py::ssize_t(p.row_heads().size())}); })
        .def("stats", &stats_dict)
        .def_property_readonly("on_device", &Plan::on_device)
        .def(
            "device_cu_seqlens",
            [](const Plan& p, int rank) { return reinterpret_cast<uintptr_t>(p.device_cu_seqlens(rank)); },
            py::arg("rank"))
        .def(
            "device_slot_expert",
            [](const Plan& p, int rank) { return reinterpret_cast<uintptr_t>(p.device_slot_expert(rank)); },
            py::arg("rank"));
}

// The Launch of one call: the caller's stream (an int cudaStream_t; 0 = the legacy default stream), SM budget (-1: the
// object's num_sms) and options (Python's keyword plan_ordered= of the ops that take it).
Launch launch_of(uintptr_t stream, int num_sms, bool plan_ordered = false) {
    return Launch{reinterpret_cast<void*>(stream), num_sms, OpOptions{plan_ordered}};
}

void bind_buffer(py::module_& m) {
    using Release = py::call_guard<py::gil_scoped_release>;
    py::class_<Buffer, std::shared_ptr<Buffer>>(m, "Buffer", "C++ flatep::Buffer over pointers; see flatep.Buffer.")
        .def(py::init([](std::shared_ptr<Transport> transport, int num_tokens, int hidden, int num_experts, int topk,
                         int align, double capacity_factor, const std::string& planner, int num_plan_slots,
                         std::shared_ptr<ExpertPools> pools) {
                 FLATEP_CHECK(transport != nullptr, "transport is None");
                 Config config;
                 config.num_ranks = transport->num_ranks();
                 config.rank = transport->rank();
                 config.num_tokens = num_tokens;
                 config.hidden = hidden;
                 config.num_experts = num_experts;
                 config.topk = topk;
                 config.align = align;
                 config.capacity_factor = capacity_factor;
                 const PlannerKind kind = planner_from_name(planner);
                 config.validate(kind);  // before any collective: a bad argument fails on the caller's rank at once
                 FLATEP_CHECK(pools == nullptr || internal::transport(*pools) == transport,
                              "Buffer: the pools were built over another group (transport) than the Buffer's");
                 py::gil_scoped_release release;
                 if (pools != nullptr) return std::make_shared<Buffer>(config, *pools, kind, num_plan_slots);
                 return std::make_shared<Buffer>(config, std::move(transport), kind, num_plan_slots);
             }),
             py::arg("transport"), py::arg("num_tokens"), py::arg("hidden"), py::arg("num_experts"), py::arg("topk"),
             py::arg("align"), py::arg("capacity_factor"), py::arg("planner"),
             py::arg("num_plan_slots") = Buffer::kDefaultPlanSlots, py::arg("pools") = nullptr,
             "pools: the ExpertPools whose plans the Buffer makes (it takes their num_slots and view_stride); None: "
             "the training layout")
        .def(
            "plan",
            [](Buffer& b, uintptr_t topk_idx, int index_bytes, int num_tokens, uintptr_t plan_storage, uintptr_t stream,
               int num_sms) {
                return b.plan(as_ptr<const void>(topk_idx), index_bytes, num_tokens, as_ptr<int32_t>(plan_storage),
                              launch_of(stream, num_sms));
            },
            py::arg("topk_idx"), py::arg("index_bytes"), py::arg("num_tokens"), py::arg("plan_storage") = 0,
            py::kw_only(), py::arg("stream") = 0, py::arg("num_sms") = -1, Release())
        .def(
            "set_placement",
            [](Buffer& b, const std::vector<int32_t>& placement, uintptr_t stream) {
                b.set_placement(placement, launch_of(stream, -1));
            },
            py::arg("placement"), py::kw_only(), py::arg("stream") = 0, Release(),
            "Collective: the static planner's placement, [R][B] expert ids flattened (-1: an empty slot)")
        .def_property_readonly(
            "placement",
            [](const Buffer& b) {
                const std::span<const int32_t> slots = b.placement();
                return std::vector<int32_t>(slots.begin(), slots.end());
            },
            "the placement set last, flattened [R][B] (empty before set_placement)")
        .def_property_readonly("placement_epoch", &Buffer::placement_epoch)
        .def_property_readonly("plan_words", &Buffer::plan_words)
        .def_property_readonly(
            "symmetric_recv",
            [](Buffer& b) {
                return py::make_tuple(reinterpret_cast<uintptr_t>(b.symmetric_recv_x()),
                                      reinterpret_cast<uintptr_t>(b.symmetric_recv_w()));
            },
            "(recv_x, recv_w) addresses of this rank's symmetric receive region ([NvS][H] bf16, [NvS] fp32)")
        .def_property_readonly("plan_offsets",
                               [](const Buffer& b) {
                                   // (slot_expert, cu_seqlens) of this rank: int32 word offsets into a device plan's
                                   // storage (the same for every plan of the Buffer), so views of them can be made
                                   // before any plan exists.
                                   const PlanSizes s = make_plan_sizes(internal::layout(b));
                                   const int64_t rank = b.config().rank;
                                   return py::make_tuple(s.slot_expert + rank * b.experts_per_rank(),
                                                         s.cu_seqlens + rank * b.num_groups());
                               })
        .def_property(
            "num_sms", &Buffer::num_sms,
            [](Buffer& b, long long num_sms) { b.set_num_sms(env::check_num_sms("Buffer", num_sms)); },
            "SM budget of calls that pass num_sms=-1: the most thread blocks one launch of an op uses (0: no cap; "
            "starts at FLATEP_NUM_SMS)")
        .def_property_readonly("poisoned", &Buffer::poisoned)
        .def(
            "dispatch",
            [](Buffer& b, const Plan& plan, uintptr_t x, uintptr_t topk_weights, uintptr_t recv_x, uintptr_t recv_w,
               uintptr_t stream, int num_sms, bool plan_ordered) {
                b.dispatch(plan, as_ptr<const uint16_t>(x), as_ptr<const float>(topk_weights), as_ptr<uint16_t>(recv_x),
                           as_ptr<float>(recv_w), launch_of(stream, num_sms, plan_ordered));
            },
            py::arg("plan"), py::arg("x"), py::arg("topk_weights"), py::arg("recv_x"), py::arg("recv_w"), py::kw_only(),
            py::arg("stream") = 0, py::arg("num_sms") = -1, py::arg("plan_ordered") = false, Release())
        .def(
            "dispatch_fp8",
            [](Buffer& b, const Plan& plan, uintptr_t x_bf16, uintptr_t x_fp8, uintptr_t x_scales,
               uintptr_t topk_weights, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_w, bool ue8m0,
               uintptr_t stream, int num_sms, bool plan_ordered) {
                b.dispatch_fp8(plan, as_ptr<const uint16_t>(x_bf16), as_ptr<const uint8_t>(x_fp8),
                               as_ptr<const float>(x_scales), as_ptr<const float>(topk_weights),
                               as_ptr<uint8_t>(recv_x), as_ptr<float>(recv_scales), as_ptr<float>(recv_w),
                               ue8m0 ? Fp8Scale::kUe8m0 : Fp8Scale::kFloat, launch_of(stream, num_sms, plan_ordered));
            },
            py::arg("plan"), py::arg("x_bf16"), py::arg("x_fp8"), py::arg("x_scales"), py::arg("topk_weights"),
            py::arg("recv_x"), py::arg("recv_scales"), py::arg("recv_w"), py::arg("ue8m0"), py::kw_only(),
            py::arg("stream") = 0, py::arg("num_sms") = -1, py::arg("plan_ordered") = false, Release())
        .def(
            "combine",
            [](Buffer& b, const Plan& plan, uintptr_t y, uintptr_t weights, uintptr_t out, uintptr_t stream,
               int num_sms, bool plan_ordered) {
                b.combine(plan, as_ptr<const uint16_t>(y), as_ptr<const float>(weights), as_ptr<uint16_t>(out),
                          launch_of(stream, num_sms, plan_ordered));
            },
            py::arg("plan"), py::arg("y"), py::arg("weights"), py::arg("out"), py::kw_only(), py::arg("stream") = 0,
            py::arg("num_sms") = -1, py::arg("plan_ordered") = false, Release())
        .def(
            "entry_values",
            [](Buffer& b, const Plan& plan, uintptr_t row_values, uintptr_t out, uintptr_t stream, int num_sms) {
                b.entry_values(plan, as_ptr<const float>(row_values), as_ptr<float>(out), launch_of(stream, num_sms));
            },
            py::arg("plan"), py::arg("row_values"), py::arg("out"), py::kw_only(), py::arg("stream") = 0,
            py::arg("num_sms") = -1, Release())
        .def(
            "combine_grad",
            [](Buffer& b, const Plan& plan, uintptr_t rows, uintptr_t y, uintptr_t weights, uintptr_t grad_y,
               uintptr_t grad_weights, uintptr_t stream, int num_sms) {
                b.combine_grad(plan, as_ptr<const uint16_t>(rows), as_ptr<const uint16_t>(y),
                               as_ptr<const float>(weights), as_ptr<uint16_t>(grad_y), as_ptr<float>(grad_weights),
                               launch_of(stream, num_sms));
            },
            py::arg("plan"), py::arg("rows"), py::arg("y"), py::arg("weights"), py::arg("grad_y"),
            py::arg("grad_weights"), py::kw_only(), py::arg("stream") = 0, py::arg("num_sms") = -1, Release())
        .def(
            "check_status", [](Buffer& b, uintptr_t stream) { b.check_status(launch_of(stream, -1)); }, py::kw_only(),
            py::arg("stream") = 0, Release())
        .def_property_readonly("on_device", &Buffer::on_device)
        .def_property_readonly("id", &Buffer::id)
        .def_property_readonly("generation", &Buffer::generation)
        .def_property_readonly("num_ranks", [](const Buffer& b) { return b.config().num_ranks; })
        .def_property_readonly("rank", [](const Buffer& b) { return b.config().rank; })
        .def_property_readonly("experts_per_rank", &Buffer::experts_per_rank)
        .def_property_readonly("capacity", &Buffer::capacity)
        .def_property_readonly("num_recv_rows", &Buffer::num_recv_rows)
        .def_property_readonly("num_groups", &Buffer::num_groups)
        .def_property_readonly("num_slots", &Buffer::num_slots)
        .def_property_readonly("view_stride", &Buffer::view_stride)
        .def_property_readonly("serving", &Buffer::serving)
        .def_property_readonly("planner", [](const Buffer& b) { return std::string(planner_name(b.planner())); });
    m.def(
        "quantize_fp8",
        [](uintptr_t x, int64_t rows, int hidden, bool ue8m0, uintptr_t q, uintptr_t scales) {
            quantize_fp8_rows(as_ptr<const uint16_t>(x), rows, hidden, ue8m0 ? Fp8Scale::kUe8m0 : Fp8Scale::kFloat,
                              as_ptr<uint8_t>(q), as_ptr<float>(scales));
        },
        py::arg("x"), py::arg("rows"), py::arg("hidden"), py::arg("ue8m0"), py::arg("q"), py::arg("scales"),
        "The C++ FP8 rule (flatep::quantize_fp8_rows) over host memory: x [rows][hidden] bf16 -> q [rows][hidden] "
        "e4m3 bytes, scales [rows][hidden/128] fp32. flatep.fp8.quantize is the same rule in torch.");
}

void bind_pools(py::module_& m) {
    using Release = py::call_guard<py::gil_scoped_release>;
    py::class_<ExpertLayer>(m, "ExpertLayer", "C++ flatep::ExpertLayer; pointers as ints, see flatep.ExpertLayer.")
        .def_property_readonly("num_projections", &ExpertLayer::num_projections)
        .def_property_readonly("pools_id", &ExpertLayer::pools_id)
        .def_property_readonly("on_device", &ExpertLayer::on_device)
        .def("weights", [](const ExpertLayer& l, int p) { return reinterpret_cast<uintptr_t>(l.weights(p)); })
        .def("grads", [](const ExpertLayer& l, int p) { return reinterpret_cast<uintptr_t>(l.grads(p)); })
        .def("own_weights", [](const ExpertLayer& l, int p) { return reinterpret_cast<uintptr_t>(l.own_weights(p)); })
        .def("own_grads", [](const ExpertLayer& l, int p) { return reinterpret_cast<uintptr_t>(l.own_grads(p)); });

    py::class_<ExpertPools, std::shared_ptr<ExpertPools>>(m, "ExpertPools",
                                                          "C++ flatep::ExpertPools; see flatep.ExpertPools.")
        .def(py::init([](std::shared_ptr<Transport> transport, int experts_per_rank,
                         const std::vector<std::vector<int64_t>>& shapes, int num_slots) {
                 std::vector<ProjectionShape> projections;
                 for (const std::vector<int64_t>& shape : shapes) {
                     FLATEP_CHECK(shape.size() == 2 || shape.size() == 3, "ExpertPools: projection ",
                                  projections.size(), " must be (rows, cols) or (rows, cols, elem_bytes)");
                     projections.push_back({shape[0], shape[1], shape.size() == 3 ? int(shape[2]) : 2});
                 }
                 py::gil_scoped_release release;
                 return std::make_shared<ExpertPools>(std::move(transport), experts_per_rank, std::move(projections),
                                                      num_slots);
             }),
             py::arg("transport"), py::arg("experts_per_rank"), py::arg("projections"), py::arg("num_slots") = -1,
             "projections: (rows, cols) or (rows, cols, elem_bytes) per projection (elem_bytes 2 by default); "
             "num_slots: B in "
             "[0, epn] or -1 (epn: training)")
        .def("register_layer", &ExpertPools::register_layer, Release())
        .def(
            "prefetch",
            [](ExpertPools& p, const Plan& plan, const ExpertLayer& layer, uintptr_t stream, int num_sms,
               bool plan_ordered) { p.prefetch(plan, layer, launch_of(stream, num_sms, plan_ordered)); },
            py::arg("plan"), py::arg("layer"), py::kw_only(), py::arg("stream") = 0, py::arg("num_sms") = -1,
            py::arg("plan_ordered") = false, Release())
        .def(
            "reduce_grad",
            [](ExpertPools& p, const Plan& plan, const ExpertLayer& layer, uintptr_t stream, int num_sms) {
                p.reduce_grad(plan, layer, launch_of(stream, num_sms));
            },
            py::arg("plan"), py::arg("layer"), py::kw_only(), py::arg("stream") = 0, py::arg("num_sms") = -1, Release())
        .def_property_readonly("poisoned", &ExpertPools::poisoned)
        .def(
            "write_grads",
            [](ExpertPools& p, const Plan& plan, const ExpertLayer& layer, int projection, uintptr_t grad,
               int grad_bytes, bool accumulate, uintptr_t stream, int num_sms) {
                p.write_grads(plan, layer, projection, as_ptr<const void>(grad), grad_bytes, accumulate,
                              launch_of(stream, num_sms));
            },
            py::arg("plan"), py::arg("layer"), py::arg("projection"), py::arg("grad"), py::arg("grad_bytes"),
            py::arg("accumulate") = false, py::kw_only(), py::arg("stream") = 0, py::arg("num_sms") = -1, Release())
        .def_property_readonly("on_device", &ExpertPools::on_device)
        .def_property(
            "num_sms", &ExpertPools::num_sms,
            [](ExpertPools& p, long long num_sms) { p.set_num_sms(env::check_num_sms("ExpertPools", num_sms)); },
            "SM budget of calls that pass num_sms=-1 (0: no cap; starts at FLATEP_NUM_SMS)")
        .def_property_readonly("id", &ExpertPools::id)
        .def("placement_bytes", &ExpertPools::placement_bytes, py::arg("plan"), py::arg("rank"))
        .def_property_readonly("experts_per_rank", &ExpertPools::experts_per_rank)
        .def_property_readonly("num_projections", &ExpertPools::num_projections)
        .def_property_readonly("num_slots", &ExpertPools::num_slots)
        .def_property_readonly("serving", &ExpertPools::serving)
        .def_property_readonly("trains", &ExpertPools::trains)
        .def_property_readonly("view_stride", &ExpertPools::view_stride)
        .def_property_readonly("view_rows", &ExpertPools::view_rows)
        .def("view_row", &ExpertPools::view_row, py::arg("expert"))
        .def("shape",
             [](const ExpertPools& p, int projection) {
                 const ProjectionShape& s = p.shape(projection);
                 return py::make_tuple(s.rows, s.cols, s.elem_bytes);
             })
        .def("slot_pool", [](const ExpertPools& p, int q) { return reinterpret_cast<uintptr_t>(p.slot_pool(q)); })
        .def("reduce_pool", [](const ExpertPools& p, int q) { return reinterpret_cast<uintptr_t>(p.reduce_pool(q)); });
}

// The expert FFN's elementwise steps (include/flatep/ffn.hpp), only in a build with CUDA: flatep.ffn checks the
// tensors (bf16, contiguous, shapes, one CUDA device) and passes their data pointers, the address of cu_seqlens' last
// element as `end` and torch's current stream.
void bind_ffn(py::module_& m) {
    m.def("make_device_current", &make_device_current, py::arg("device"),
          "flatep::make_device_current: the device's primary CUDA context current on the calling thread "
          "(cudaSetDevice); a thread that never called into CUDA has none. kRuntime in a build without CUDA.");
#ifdef FLATEP_WITH_CUDA
    using Release = py::call_guard<py::gil_scoped_release>;
    m.def(
        "activate_rows",
        [](uintptr_t h, uintptr_t a, int64_t rows, int64_t ffn, bool swiglu, uintptr_t end, bool zero_past_end,
           uintptr_t stream, int num_sms) {
            activate_rows(as_ptr<const uint16_t>(h), as_ptr<uint16_t>(a), rows, ffn,
                          swiglu ? FfnActivation::kSwiglu : FfnActivation::kSilu, as_ptr<const int32_t>(end),
                          zero_past_end ? PastEnd::kZero : PastEnd::kUntouched, launch_of(stream, num_sms));
        },
        py::arg("h"), py::arg("a"), py::arg("rows"), py::arg("ffn"), py::arg("swiglu"), py::arg("end"), py::kw_only(),
        py::arg("zero_past_end") = true, py::arg("stream") = 0, py::arg("num_sms") = -1, Release(),
        "flatep::activate_rows on device pointers: a [rows][ffn] bf16 = silu(gate) * up (swiglu, h [rows][2*ffn]) or "
        "silu(h) (h [rows][ffn]) on the rows below *end (int32, read on the device); the others zero "
        "(zero_past_end) or untouched. See flatep.ffn.activate_rows.");
    m.def(
        "zero_rows_from_end",
        [](uintptr_t y, int64_t rows, int64_t cols, uintptr_t end, uintptr_t stream, int num_sms) {
            zero_rows_from_end(as_ptr<uint16_t>(y), rows, cols, as_ptr<const int32_t>(end), launch_of(stream, num_sms));
        },
        py::arg("y"), py::arg("rows"), py::arg("cols"), py::arg("end"), py::kw_only(), py::arg("stream") = 0,
        py::arg("num_sms") = -1, Release(),
        "flatep::zero_rows_from_end on device pointers: rows [*end, rows) of y [rows][cols] bf16 set to zero. See "
        "flatep.ffn.zero_rows_from_end.");
#else
    (void)m;
#endif
}

void bind_routing(py::module_& m) {
    py::module_ r = m.def_submodule("routing", "Routing generator of design §9 (src/routing/routing.hpp).");
    r.def("popularity", &routing::popularity, py::arg("num_experts"), py::arg("sigma"), py::arg("seed"));
    r.def(
        "sample_topk",
        [](const std::vector<double>& popularity, int num_tokens, int topk, uint64_t seed, int rank) {
            FLATEP_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
            FLATEP_CHECK(topk >= 1 && topk <= int(popularity.size()), "topk must be in [1, ", popularity.size(),
                         "], got ", topk);
            py::array_t<int32_t> out({py::ssize_t(num_tokens), py::ssize_t(topk)});
            routing::sample_topk(popularity, num_tokens, topk, seed, rank, out.mutable_data());
            return out;
        },
        py::arg("popularity"), py::arg("num_tokens"), py::arg("topk"), py::arg("seed"), py::arg("rank"));
    r.def(
        "generate_counts",
        [](int num_ranks, int num_experts, int num_tokens, int topk, double sigma, uint64_t seed) {
            std::vector<int32_t> counts =
                routing::generate_counts(num_ranks, num_experts, num_tokens, topk, sigma, seed);
            return to_array(counts, {num_ranks, num_experts});
        },
        py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_tokens"), py::arg("topk"), py::arg("sigma"),
        py::arg("seed"));
    r.def(
        "maxvio",
        [](py::array_t<int32_t, py::array::c_style | py::array::forcecast> tpe_all) {
            FLATEP_CHECK(tpe_all.ndim() == 2, "tpe_all must be 2-D [R, E], got ", tpe_all.ndim(), " dimensions");
            return routing::maxvio(tpe_all.data(), int(tpe_all.shape(0)), int(tpe_all.shape(1)));
        },
        py::arg("tpe_all"));
    r.def("sigma_for_maxvio", &routing::sigma_for_maxvio, py::arg("target"), py::arg("num_ranks"),
          py::arg("num_experts"), py::arg("num_tokens"), py::arg("topk"), py::arg("seed"));
}

}  // namespace
}  // namespace flatep

PYBIND11_MODULE(_C, m) {
    m.doc() = "FlatEP C++ runtime (torch-free; tensors cross as data pointers). Use the flatep package.";
    flatep::bind_errors(m);
    flatep::bind_transport(m);
    flatep::bind_plan(m);
    flatep::bind_buffer(m);
    flatep::bind_pools(m);
    flatep::bind_ffn(m);
    flatep::bind_routing(m);
#ifdef FLATEP_WITH_CUDA
    m.attr("has_cuda") = true;
#else
    m.attr("has_cuda") = false;
#endif
}
