// flatep-plan-quality: the host half of the planner-quality benchmark (driven by benchmarks/plan_quality.py).
// For one config, a maxvio sweep and several seeds it generates the count matrices with the routing generator,
// writes each one as a flatep-plan / plan_optimum.py request (JSON), and plans it with the greedy and the balanced
// planner for every capacity factor, writing one CSV row per (case, capacity factor, planner) with P, replicas,
// entries moved, local fraction and the median host planner time.
//
//   flatep-plan-quality [--R 8] [--E 384] [--S 8192] [--K 8] [--align 128] [--maxvio 0.2,1,5,10,20] [--seeds 3]
//                       [--factors 1,1.05,1.1,1.25] [--repeats 11] [--dump DIR] [--csv plan_quality_host.csv]
//
// Request files are named DIR/R{R}_E{E}_S{S}_K{K}_mv{maxvio}_s{seed}_f{factor}.json.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"
#include "routing/routing.hpp"

namespace {

struct Options {
    flatep::Config config;
    std::vector<double> maxvio{0.2, 1.0, 5.0, 10.0, 20.0};
    std::vector<double> factors{1.0, 1.05, 1.1, 1.25};
    int seeds = 3;
    int repeats = 11;
    std::string dump;
    std::string csv = "plan_quality_host.csv";
};

[[noreturn]] void usage_error(const std::string& message) {
    std::fprintf(stderr, "flatep-plan-quality: error: %s\n", message.c_str());
    std::exit(1);
}

std::vector<double> parse_list(const std::string& flag, const std::string& value) {
    std::vector<double> out;
    std::stringstream ss(value);
    std::string item;
    while (std::getline(ss, item, ',')) {
        char* end = nullptr;
        out.push_back(std::strtod(item.c_str(), &end));
        if (*end != '\0' || item.empty()) usage_error("bad number in " + flag + ": " + item);
    }
    if (out.empty()) usage_error(flag + " needs at least one value");
    return out;
}

Options parse(int argc, char** argv) {
    Options o;
    o.config.num_ranks = 8;
    o.config.num_experts = 384;
    o.config.num_tokens = 8192;
    o.config.topk = 8;
    o.config.hidden = 8;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (flag == "--help" || flag == "-h") {
            std::printf(
                "usage: flatep-plan-quality [--R n] [--E n] [--S n] [--K n] [--align n] [--maxvio a,b,..]\n"
                "                           [--seeds n] [--factors f,..] [--repeats n] [--dump DIR] [--csv path]\n");
            std::exit(0);
        }
        if (i + 1 >= argc) usage_error("option " + flag + " needs a value");
        const std::string value = argv[++i];
        auto as_int = [&]() {
            char* end = nullptr;
            const long v = std::strtol(value.c_str(), &end, 10);
            if (*end != '\0' || v < 1 || v > (1L << 30)) usage_error("bad integer for " + flag + ": " + value);
            return int(v);
        };
        if (flag == "--R") {
            o.config.num_ranks = as_int();
        } else if (flag == "--E") {
            o.config.num_experts = as_int();
        } else if (flag == "--S") {
            o.config.num_tokens = as_int();
        } else if (flag == "--K") {
            o.config.topk = as_int();
        } else if (flag == "--align") {
            o.config.align = as_int();
        } else if (flag == "--seeds") {
            o.seeds = as_int();
        } else if (flag == "--repeats") {
            o.repeats = as_int();
        } else if (flag == "--maxvio") {
            o.maxvio = parse_list(flag, value);
        } else if (flag == "--factors") {
            o.factors = parse_list(flag, value);
        } else if (flag == "--dump") {
            o.dump = value;
        } else if (flag == "--csv") {
            o.csv = value;
        } else {
            usage_error("unknown option " + flag);
        }
    }
    return o;
}

std::string fmt(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
}

void write_request(const std::string& path, const flatep::Config& c, const std::vector<int32_t>& counts) {
    std::ofstream out(path);
    if (!out) usage_error("cannot write " + path);
    out << "{\"R\":" << c.num_ranks << ",\"E\":" << c.num_experts << ",\"S\":" << c.num_tokens << ",\"K\":" << c.topk
        << ",\"align\":" << c.align << ",\"capacity_factor\":" << fmt(c.capacity_factor) << ",\"tpe\":[";
    for (int s = 0; s < c.num_ranks; ++s) {
        out << (s ? ",[" : "[");
        for (int e = 0; e < c.num_experts; ++e) out << (e ? "," : "") << counts[size_t(s) * c.num_experts + e];
        out << "]";
    }
    out << "]}\n";
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Options o = parse(argc, argv);
        const flatep::Config& base = o.config;
        const int R = base.num_ranks, E = base.num_experts, S = base.num_tokens, K = base.topk;
        std::ofstream csv(o.csv);
        if (!csv) usage_error("cannot write " + o.csv);
        csv << "R,E,S,K,capacity_factor,maxvio_target,maxvio_real,seed,request,planner,makespan,total_replicas,"
               "entries_moved,entries_total,local_fraction,host_time_us\n";
        for (double target : o.maxvio) {
            const double sigma = flatep::routing::sigma_for_maxvio(target, R, E, S, K, 1);
            for (int si = 0; si < o.seeds; ++si) {
                const uint64_t seed = uint64_t(si) + 1;
                const std::vector<int32_t> counts = flatep::routing::generate_counts(R, E, S, K, sigma, seed);
                const double real = flatep::routing::maxvio(counts.data(), R, E);
                for (double factor : o.factors) {
                    flatep::Config c = base;
                    c.capacity_factor = factor;
                    const flatep::Layout l = flatep::make_layout(c);
                    std::string request;
                    if (!o.dump.empty()) {
                        request = o.dump + "/R" + std::to_string(R) + "_E" + std::to_string(E) + "_S" +
                                  std::to_string(S) + "_K" + std::to_string(K) + "_mv" + fmt(target) + "_s" +
                                  std::to_string(seed) + "_f" + fmt(factor) + ".json";
                        write_request(request, c, counts);
                    }
                    for (flatep::PlannerKind kind : {flatep::PlannerKind::kGreedy, flatep::PlannerKind::kBalanced}) {
                        flatep::HostPlan plan(l);
                        std::copy(counts.begin(), counts.end(), plan.view.tpe_all);
                        std::vector<double> times;
                        for (int rep = 0; rep < o.repeats; ++rep) {
                            const auto t0 = std::chrono::steady_clock::now();
                            flatep::plan_counts(l, kind, plan.view);
                            const auto t1 = std::chrono::steady_clock::now();
                            times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
                        }
                        std::sort(times.begin(), times.end());
                        const std::string bad = flatep::check_plan(l, plan.view);
                        if (!bad.empty())
                            usage_error(std::string("invalid ") + flatep::planner_name(kind) + " plan (maxvio " +
                                        fmt(target) + ", seed " + std::to_string(seed) + "): " + bad);
                        const flatep::PlanStats& st = *plan.view.stats;
                        const double local =
                            st.entries_total ? double(st.entries_on_source) / double(st.entries_total) : 1.0;
                        csv << R << ',' << E << ',' << S << ',' << K << ',' << fmt(factor) << ',' << fmt(target) << ','
                            << real << ',' << seed << ',' << request << ',' << flatep::planner_name(kind) << ','
                            << st.makespan << ',' << st.total_replicas << ',' << st.entries_moved << ','
                            << st.entries_total << ',' << local << ',' << times[times.size() / 2] << '\n';
                    }
                }
            }
        }
        if (!csv.flush()) usage_error("cannot write " + o.csv);
    } catch (const flatep::Error& e) {
        usage_error(e.message());
    }
    return 0;
}
