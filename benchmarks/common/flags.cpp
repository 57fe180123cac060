#include "flags.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "flatep/error.hpp"
#include "internal/api.hpp"

namespace flatep::bench {

Config Shape::config() const {
    Config c;
    c.num_ranks = ranks;
    c.num_tokens = tokens;
    c.hidden = hidden;
    c.num_experts = experts;
    c.topk = topk;
    c.align = align;
    c.capacity_factor = capacity_factor;
    return c;
}

std::string Shape::label() const {
    std::string s = "R" + std::to_string(ranks) + "_S" + std::to_string(tokens) + "_E" + std::to_string(experts) +
                    "_H" + std::to_string(hidden) + "_K" + std::to_string(topk);
    if (align != 128) s += "_A" + std::to_string(align);
    if (capacity_factor != 1.0) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "_C%g", capacity_factor);
        s += buf;
    }
    return s;
}

double Skew::sigma_for(const Shape& s, uint64_t seed, int bisection_ranks) const {
    if (is_sigma) return value;
    const int ranks = bisection_ranks > 0 ? std::min(s.ranks, bisection_ranks) : s.ranks;
    return routing::sigma_for_maxvio(value, ranks, s.experts, s.tokens, s.topk, seed);
}

const std::vector<Preset>& presets() {
    static const std::vector<Preset> all = [] {
        std::vector<Preset> p;
        Preset moonep;
        moonep.name = "moonep";
        moonep.description = "MoonEP's config: R=8 S=8192 E=384 H=7168 K=8, maxvio 0.2,1,10,20";
        moonep.ranks = {8};
        moonep.tokens = {8192};
        moonep.experts = {384};
        moonep.hidden = {7168};
        moonep.topk = {8};
        moonep.maxvio = {0.2, 1.0, 10.0, 20.0};
        p.push_back(moonep);
        Preset deepep = moonep;
        deepep.name = "deepep";
        deepep.description = "DeepEP's config: R=8 S=4096 E=256 H=7168 K=8, uniform routing (sigma 0)";
        deepep.tokens = {4096};
        deepep.experts = {256};
        deepep.maxvio = {};
        deepep.sigma = {0.0};
        p.push_back(deepep);
        Preset sweep = moonep;
        sweep.name = "moonep-sweep";
        sweep.description = "MoonEP's sweep: S=8192 E=896, H 3584,7168, K 8,16, R 8,16,32,64, maxvio 1,5,20";
        sweep.ranks = {8, 16, 32, 64};
        sweep.experts = {896};
        sweep.hidden = {3584, 7168};
        sweep.topk = {8, 16};
        sweep.maxvio = {1.0, 5.0, 20.0};
        p.push_back(sweep);
        Preset k3 = sweep;
        k3.name = "k3";
        k3.description = "Kimi K3's shape on 8 ranks: R=8 S=8192 E=896 H=7168 K 8,16, maxvio 1,5,20";
        k3.ranks = {8};
        k3.hidden = {7168};
        p.push_back(k3);
        return p;
    }();
    return all;
}

namespace {

std::vector<std::string> preset_names() {
    std::vector<std::string> names;
    for (const Preset& p : presets()) names.push_back(p.name);
    return names;
}

std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const std::string& x : v) s += (s.empty() ? "" : ",") + x;
    return s;
}

}  // namespace

struct Flags::Impl {
    std::string program;
    CLI::App app;
    // add_sweep: the command line's values (empty: not given).
    bool sweep = false;
    std::vector<std::string> default_presets, preset;
    int default_ffn = 2048;
    std::vector<int> ranks, tokens, hidden, ffn, experts, topk, align;
    std::vector<double> capacity_factor, maxvio, sigma;

    Impl(std::string name, std::string description) : program(std::move(name)), app(std::move(description), program) {
        app.option_defaults()->always_capture_default();
    }
    CLI::Option* ints(const std::string& name, std::vector<int>* v, const std::string& help, int min) {
        return app.add_option(name, *v, help)->delimiter(',')->check(CLI::Range(min, 1 << 30));
    }
};

Flags::Flags(std::string program, std::string description)
    : impl_(std::make_unique<Impl>(std::move(program), std::move(description))) {}

Flags::~Flags() = default;

void Flags::add_sweep(std::vector<std::string> default_presets, int default_ffn) {
    Impl& m = *impl_;
    m.sweep = true;
    m.default_presets = std::move(default_presets);
    m.default_ffn = default_ffn;
    std::string footer = "Presets (--preset):\n";
    for (const Preset& p : presets()) footer += "  " + p.name + ": " + p.description + "\n";
    m.app.footer(footer);
    m.app.add_option("--preset", m.preset, "named sweeps to run (default " + join(m.default_presets) + ")")
        ->delimiter(',')
        ->check(CLI::IsMember(preset_names()));
    m.ints("--ranks", &m.ranks, "R: ranks, a list sweeps", 1);
    m.ints("--tokens", &m.tokens, "S: tokens per rank", 1);
    m.ints("--hidden", &m.hidden, "H: row width (bf16 elements)", 8);
    m.ints("--ffn", &m.ffn, "H': expert width (default " + std::to_string(default_ffn) + ")", 1);
    m.ints("--experts", &m.experts, "E: routed experts", 1);
    m.ints("--topk", &m.topk, "K: experts per token", 1);
    m.ints("--align", &m.align, "row padding of each expert group (default 128)", 1);
    m.app.add_option("--capacity-factor", m.capacity_factor, "1: exact mode, > 1: slack (default 1)")
        ->delimiter(',')
        ->check(CLI::Range(1.0, 4.0));
    auto* mv = m.app.add_option("--maxvio", m.maxvio, "target maxvios of the routing (sigma by bisection)")
                   ->delimiter(',')
                   ->check(CLI::Range(0.0, 1e6));
    m.app.add_option("--sigma", m.sigma, "the routing generator's sigmas (0: uniform)")
        ->delimiter(',')
        ->check(CLI::Range(0.0, 100.0))
        ->excludes(mv);
}

void Flags::add_shape(Shape* s) {
    CLI::App& app = impl_->app;
    app.add_option("--ranks", s->ranks, "R: ranks")->check(CLI::Range(1, 1 << 30));
    app.add_option("--tokens", s->tokens, "S: tokens per rank")->check(CLI::Range(1, 1 << 30));
    app.add_option("--hidden", s->hidden, "H: row width (bf16 elements)")->check(CLI::Range(8, 1 << 30));
    app.add_option("--ffn", s->ffn, "H': expert width")->check(CLI::Range(1, 1 << 30));
    app.add_option("--experts", s->experts, "E: routed experts")->check(CLI::Range(1, 1 << 30));
    app.add_option("--topk", s->topk, "K: experts per token")->check(CLI::Range(1, 1 << 30));
    app.add_option("--align", s->align, "row padding of each expert group")->check(CLI::Range(1, 1 << 30));
    app.add_option("--capacity-factor", s->capacity_factor, "1: exact mode, > 1: slack")->check(CLI::Range(1.0, 4.0));
}

void Flags::add_timing(int* iters, int* warmup) {
    impl_->app.add_option("--iters", *iters, "timed iterations (median reported)")->check(CLI::Range(1, 1 << 30));
    impl_->app.add_option("--warmup", *warmup, "untimed iterations first")->check(CLI::Range(0, 1 << 30));
}

void Flags::add_csv(std::string* path) { impl_->app.add_option("--csv", *path, "CSV output path"); }

void Flags::add_memory(double* gib) {
    impl_->app
        .add_option("--memory-gib", *gib,
                    "GiB of device memory to plan the cases for, instead of what cudaMemGetInfo finds free (0: that)")
        ->check(CLI::Range(0.0, 1e6));
}

void Flags::add(const std::string& name, int* value, const std::string& help, int min, int max) {
    impl_->app.add_option(name, *value, help)->check(CLI::Range(min, max));
}
void Flags::add(const std::string& name, uint64_t* value, const std::string& help) {
    impl_->app.add_option(name, *value, help);
}
void Flags::add(const std::string& name, double* value, const std::string& help) {
    impl_->app.add_option(name, *value, help);
}
void Flags::add(const std::string& name, std::string* value, const std::string& help,
                const std::vector<std::string>& choices) {
    CLI::Option* o = impl_->app.add_option(name, *value, help);
    if (!choices.empty()) o->check(CLI::IsMember(choices));
}
void Flags::add(const std::string& name, std::vector<double>* value, const std::string& help) {
    impl_->app.add_option(name, *value, help)->delimiter(',');
}
void Flags::add(const std::string& name, std::vector<int>* value, const std::string& help) {
    impl_->app.add_option(name, *value, help)->delimiter(',');
}
void Flags::add(const std::string& name, std::vector<std::string>* value, const std::string& help,
                const std::vector<std::string>& choices) {
    CLI::Option* o = impl_->app.add_option(name, *value, help)->delimiter(',');
    if (!choices.empty()) o->check(CLI::IsMember(choices));
}
void Flags::add_switch(const std::string& name, bool* value, const std::string& help) {
    impl_->app.add_flag(name, *value, help);
}

void Flags::parse(int argc, char** argv) {
    try {
        impl_->app.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
        std::printf("%s", impl_->app.help().c_str());
        std::exit(0);
    } catch (const CLI::ParseError& e) {
        fail(e.what());
    }
}

bool Flags::given(const std::string& name) const { return impl_->app.count(name) > 0; }

std::vector<Case> Flags::cases() const {
    const Impl& m = *impl_;
    if (!m.sweep) return {};
    std::vector<Case> out;
    for (const std::string& name : m.preset.empty() ? m.default_presets : m.preset) {
        Preset p;
        for (const Preset& q : presets())
            if (q.name == name) p = q;
        if (p.name.empty()) fail("unknown preset '" + name + "'");
        auto take = [](std::vector<int>& field, const std::vector<int>& given, int fallback) {
            if (!given.empty()) field = given;
            if (field.empty()) field = {fallback};
        };
        const Shape d;
        take(p.ranks, m.ranks, d.ranks);
        take(p.tokens, m.tokens, d.tokens);
        take(p.hidden, m.hidden, d.hidden);
        take(p.ffn, m.ffn, m.default_ffn);
        take(p.experts, m.experts, d.experts);
        take(p.topk, m.topk, d.topk);
        take(p.align, m.align, d.align);
        if (!m.capacity_factor.empty()) p.capacity_factor = m.capacity_factor;
        if (p.capacity_factor.empty()) p.capacity_factor = {1.0};
        if (!m.maxvio.empty()) p.maxvio = m.maxvio, p.sigma.clear();
        if (!m.sigma.empty()) p.sigma = m.sigma, p.maxvio.clear();
        std::vector<Skew> skews;
        for (double v : p.maxvio) skews.push_back(Skew{false, v});
        for (double v : p.sigma) skews.push_back(Skew{true, v});
        if (skews.empty()) skews.push_back(Skew{true, 0.0});
        for (int R : p.ranks)
            for (int E : p.experts)
                for (int H : p.hidden)
                    for (int K : p.topk)
                        for (int S : p.tokens)
                            for (int F : p.ffn)
                                for (int A : p.align)
                                    for (double cf : p.capacity_factor)
                                        for (const Skew& k : skews)
                                            out.push_back(Case{p.name, Shape{R, S, H, F, E, K, A, cf}, k});
    }
    return out;
}

Config Flags::validated(const Shape& shape) const {
    const Config c = shape.config();
    try {
        c.validate();
    } catch (const Error& e) {
        fail("shape " + shape.label() + ": " + e.message());
    }
    return c;
}

void Flags::fail(const std::string& message) const {
    std::fprintf(stderr, "%s: error: %s\n(%s --help lists the flags)\n", impl_->program.c_str(), message.c_str(),
                 impl_->program.c_str());
    std::exit(2);
}

}  // namespace flatep::bench
