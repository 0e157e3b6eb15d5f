// The kernels compiled into the fake driver, by name, each with a launcher that unpacks the
// driver API's `kernelParams` into the kernel's own parameter types.
//
// `cargo xtask gpu-emu` generates one translation unit per `kernels-cu/<stem>.cu`: it includes
// the .cu file, then names every kernel it defines (found in the compiled object) with
// `FAKE_CUDA_KERNEL(name)`, so a new kernel is registered without anyone listing it.
#pragma once

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "launch.h"

namespace fake_cuda {

struct Param {
    std::size_t size;
    bool pointer;  // a device pointer: checked against the live allocations at launch
};

struct Kernel {
    const char* name;
    std::vector<Param> params;
    // Runs the kernel on the emulator (launch.h) with `shared` bytes of dynamic shared memory;
    // `args[i]` points at parameter i's value, as cuLaunchKernel's `kernelParams` do.
    void (*run)(const char* name, dim3 grid, dim3 block, unsigned shared, void* const* args);
};

// Adds a kernel; a second kernel of the same name is reported when the driver initialises.
void register_kernel(Kernel kernel);

// The kernel named `name`, or null.
const Kernel* find_kernel(const char* name);

// The reason the registry is unusable (a name registered twice), or null.
const char* registry_error();

// One parameter's value, copied from where `kernelParams` points (no alignment assumed).
template <typename T>
T load_param(const void* p) {
    static_assert(std::is_trivially_copyable_v<T>, "kernel parameters are copied bytes");
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <typename F>
struct Signature;

template <typename... P>
struct Signature<void (*)(P...)> {
    static constexpr std::size_t arity = sizeof...(P);
    static std::vector<Param> params() { return {Param{sizeof(P), std::is_pointer_v<P>}...}; }

    template <auto K, std::size_t... I>
    static void run(const char* name, dim3 grid, dim3 block, unsigned shared, void* const* args,
                    std::index_sequence<I...>) {
        ::emu::launch_shared(name, K, grid, block, shared, load_param<P>(args[I])...);
    }
};

template <auto K>
void run_kernel(const char* name, dim3 grid, dim3 block, unsigned shared, void* const* args) {
    using S = Signature<decltype(K)>;
    S::template run<K>(name, grid, block, shared, args, std::make_index_sequence<S::arity>{});
}

// A host stand-in for kernel K, where one is declared (a specialisation with `present = true` and
// `static void run(dim3 grid, unsigned shared, P... params)`): it computes what the kernel's grid computes, block
// by block, without emulating its threads. Only for kernels whose warp-level emulation costs far
// more than the tests can afford under the fake driver; `cargo xtask kernels-emu` still runs the
// kernels themselves, lane by lane. `run` also gets the launch's dynamic shared memory, to refuse
// less than the kernel needs.
template <auto K>
struct StandIn {
    static constexpr bool present = false;
};

template <auto K, typename S>
struct StandInRunner;

template <auto K, typename... P>
struct StandInRunner<K, void (*)(P...)> {
    template <std::size_t... I>
    static void run(dim3 grid, unsigned shared, void* const* args, std::index_sequence<I...>) {
        StandIn<K>::run(grid, shared, load_param<P>(args[I])...);
    }
};

template <auto K>
void run_stand_in(const char* name, dim3 grid, dim3, unsigned shared, void* const* args) {
    ::emu::run_on_host(name, [&] {
        StandInRunner<K, decltype(K)>::run(grid, shared, args,
                                           std::make_index_sequence<Signature<decltype(K)>::arity>{});
    });
}

struct Registration {
    template <auto K>
    static Registration of(const char* name) {
        if constexpr (StandIn<K>::present) {
            register_kernel({name, Signature<decltype(K)>::params(), &run_stand_in<K>});
        } else {
            register_kernel({name, Signature<decltype(K)>::params(), &run_kernel<K>});
        }
        return {};
    }
};

}  // namespace fake_cuda

#define FAKE_CUDA_KERNEL(kernel)                                                          \
    static_assert(std::is_function_v<decltype(kernel)>, #kernel " is not a kernel");     \
    static const ::fake_cuda::Registration fake_cuda_register_##kernel =                  \
        ::fake_cuda::Registration::of<&kernel>(#kernel);
