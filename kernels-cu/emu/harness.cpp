// The harness's helpers and `main`: runs every registered kernel test, one line each, with the
// block's threads as OS threads and again as fibers, then `emu: N passed, M failed`. A first
// argument `--threads` or `--fibers` runs one of the two only, and `--shard K/N` after it every
// N-th test (xtask runs the fibers and two shards of the OS threads as three processes at once:
// the fibers keep one core busy, the OS threads mostly wait on each other). The other arguments name the kernels that must have a test
// (xtask passes every kernel it finds in the .cu files); the exit status is non-zero if any test
// failed or is missing.
#include "harness.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

namespace emu_test {

std::vector<Test>& registry() {
    static std::vector<Test> tests;
    return tests;
}

// At most this many failure lines per test, so a broken kernel does not flood the log.
constexpr std::size_t kMaxFailures = 8;

void Check::failed(std::string line) {
    if (failures_.size() < kMaxFailures) failures_.push_back(std::move(line));
}

void Check::near(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                 const std::vector<double>& bound) {
    ++cases_;
    if (got.size() != want.size() || bound.size() != want.size()) {
        failed(what + ": sizes differ");
        return;
    }
    std::size_t bad = 0, worst = 0;
    double worst_ratio = -1.0;
    for (std::size_t i = 0; i < got.size(); ++i) {
        const double g = got[i], w = want[i];
        bool ok;
        if (std::isnan(g) || std::isnan(w)) {
            ok = std::isnan(g) && std::isnan(w);
        } else if (std::isinf(g) || std::isinf(w)) {
            ok = g == w;
        } else {
            ok = std::fabs(g - w) <= bound[i];
        }
        if (ok) continue;
        ++bad;
        const double ratio = std::isfinite(g - w) ? std::fabs(g - w) / std::max(bound[i], 1e-300) : INFINITY;
        if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
    }
    if (bad != 0) {
        char line[256];
        std::snprintf(line, sizeof line, "%s: %zu of %zu off; worst [%zu]: got %.9g, want %.9g, bound %.3g", what.c_str(),
                      bad, got.size(), worst, got[worst], want[worst], bound[worst]);
        failed(line);
    }
}

void Check::near(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                 double atol, double rtol) {
    std::vector<double> bound(want.size());
    for (std::size_t i = 0; i < want.size(); ++i) bound[i] = atol + rtol * std::fabs(want[i]);
    near(what, got, want, bound);
}

template <typename T>
void Check::exact_bits(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
    ++cases_;
    if (got.size() != want.size()) {
        failed(what + ": sizes differ");
        return;
    }
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
        if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && bad++ == 0) first = i;
    }
    if (bad != 0) {
        std::uint32_t g = 0, w = 0;
        std::memcpy(&g, &got[first], sizeof(T));
        std::memcpy(&w, &want[first], sizeof(T));
        char line[256];
        std::snprintf(line, sizeof line, "%s: %zu of %zu differ; first [%zu]: got bits %#x, want %#x", what.c_str(), bad,
                      got.size(), first, g, w);
        failed(line);
    }
}

void Check::exact(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
    exact_bits(what, got, want);
}

void Check::exact(const std::string& what, const std::vector<std::uint16_t>& got,
                  const std::vector<std::uint16_t>& want) {
    exact_bits(what, got, want);
}

std::uint64_t Rng::next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float Rng::uniform(float lo, float hi) {
    const double u = (double)(next() >> 11) * 0x1.0p-53;
    return (float)(lo + (hi - lo) * u);
}

std::vector<float> random_f32(std::size_t n, std::uint64_t seed, float lo, float hi) {
    Rng rng(seed);
    std::vector<float> v(n);
    for (auto& x : v) x = rng.uniform(lo, hi);
    return v;
}

std::uint16_t bf16_from_f32(float x) {
    std::uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const std::uint16_t sign = (std::uint16_t)(u >> 16 & 0x8000u);
    if (std::isnan(x)) return (std::uint16_t)(u >> 16 | 0x0040u);
    if (std::isinf(x)) return sign | 0x7f80u;
    // Truncation gives the neighbour towards zero; the next bf16 pattern the one away from it
    // (0x7f80 is infinity, which rounding treats as 2^128).
    const std::uint16_t low = (std::uint16_t)(u >> 16 & 0x7fffu);
    const std::uint16_t high = (std::uint16_t)(low + 1);
    const double a = std::fabs((double)x);
    const double lo = bf16_value(low);
    const double hi = high == 0x7f80u ? std::ldexp(1.0, 128) : bf16_value(high);
    std::uint16_t pick;
    if (a - lo < hi - a) {
        pick = low;
    } else if (a - lo > hi - a) {
        pick = high;
    } else {
        pick = (low & 1u) ? high : low;
    }
    return sign | pick;
}

double bf16_value(std::uint16_t b) {
    const int exponent = b >> 7 & 0xff;
    const int significand = b & 0x7f;
    const double sign = (b & 0x8000u) ? -1.0 : 1.0;
    if (exponent == 0xff) return significand ? NAN : sign * INFINITY;
    if (exponent == 0) return sign * std::ldexp((double)significand, -133);  // subnormal: 0.m x 2^-126
    return sign * std::ldexp(128.0 + significand, exponent - 127 - 7);
}

dim3 elementwise_grid(std::uint64_t n) {
    const std::uint64_t blocks = std::clamp<std::uint64_t>((n + 255) / 256, 1, 1u << 20);
    return dim3((unsigned)blocks);
}

dim3 streaming_grid(std::uint64_t units) {
    const std::uint64_t blocks = std::clamp<std::uint64_t>((units + 255) / 256, 1, 132 * 8 * 4);
    return dim3((unsigned)blocks);
}

std::vector<LaunchShape> streaming_shapes(std::uint64_t units) {
    auto shapes = grid_stride_shapes(units);
    shapes[0] = {"backend launch", streaming_grid(units), dim3(256)};
    return shapes;
}

std::vector<LaunchShape> grid_stride_shapes(std::uint64_t n) {
    return {
        {"backend launch", elementwise_grid(n), dim3(256)},
        {"3 blocks of 64", dim3(3), dim3(64)},
        {"2 blocks of 100", dim3(2), dim3(100)},
        {"1 block of 1024", dim3(1), dim3(1024)},
    };
}

std::string num(double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", v);
    return text;
}

double silu_ref(double x) { return x / (1.0 + std::exp(-x)); }

}  // namespace emu_test

namespace {

// A kernel that never returns (a barrier some thread never reaches) must not hang CI: each test
// has this long (the slowest, a tensor-core conv under OS threads, takes under a minute on CI's
// two cores).
constexpr unsigned kTimeoutSeconds = 300;
const char* volatile g_running = "(none)";

void on_timeout(int) {
    const char* head = "emu: timed out in the test of ";
    (void)!write(2, head, std::strlen(head));
    (void)!write(2, g_running, std::strlen(g_running));
    (void)!write(2, "\n", 1);
    _exit(2);
}

}  // namespace

int main(int argc, char** argv) {
    std::signal(SIGALRM, on_timeout);
    auto& tests = emu_test::registry();
    std::sort(tests.begin(), tests.end(),
              [](const emu_test::Test& a, const emu_test::Test& b) { return std::strcmp(a.kernel, b.kernel) < 0; });
    std::set<std::string> tested;
    for (const auto& t : tests) tested.insert(t.kernel);
    std::vector<bool> modes = {false, true};
    int first = 1;
    if (argc > 1 && std::strcmp(argv[1], "--threads") == 0) {
        modes = {false};
        first = 2;
    } else if (argc > 1 && std::strcmp(argv[1], "--fibers") == 0) {
        modes = {true};
        first = 2;
    }
    // `--shard K/N`: the tests whose place in the sorted list is K modulo N, and no check of the
    // kernel list (the whole run of N shards makes it once each: shard 0 does).
    unsigned shard = 0, shards = 1;
    if (argc > first + 1 && std::strcmp(argv[first], "--shard") == 0) {
        if (std::sscanf(argv[first + 1], "%u/%u", &shard, &shards) != 2 || shards == 0 || shard >= shards) {
            std::printf("FAIL --shard wants K/N with K < N, not %s\n", argv[first + 1]);
            return 1;
        }
        first += 2;
    }
    int passed = 0, failed = 0;
    for (int i = first; i < argc && shard == 0; ++i) {
        if (tested.count(argv[i]) == 0) {
            std::printf("FAIL %-34s no emulator test (add a KERNEL_TEST)\n", argv[i]);
            ++failed;
        }
    }
    // Every test under both ways of running a block's threads: OS threads, which really run at
    // the same time, and the fibers the fake driver (fake_driver/) runs the backend's tests on.
    for (const bool fibers : modes) {
        emu::use_fibers(fibers);
        std::printf("-- threads as %s\n", fibers ? "fibers" : "OS threads");
        for (std::size_t i = shard; i < tests.size(); i += shards) {
            const auto& t = tests[i];
            g_running = t.kernel;
            alarm(kTimeoutSeconds);
            emu_test::Check check;
            const auto start = std::chrono::steady_clock::now();
            t.fn(check);
            const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            const bool ok = check.failures().empty();
            std::printf("%s %-34s %3d cases  %6.2f s\n", ok ? "ok  " : "FAIL", t.kernel, check.cases(), secs);
            for (const auto& f : check.failures()) std::printf("       %s\n", f.c_str());
            std::fflush(stdout);
            (ok ? passed : failed) += 1;
        }
    }
    std::printf("emu: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
