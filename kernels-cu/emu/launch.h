// Kernel launches on the emulator: `EMU_LAUNCH(kernel, grid, block, args...)` is
// `kernel<<<grid, block>>>(args...)`, synchronous; `EMU_LAUNCH_SHARED(kernel, grid, block, bytes,
// args...)` is `kernel<<<grid, block, bytes>>>(args...)`.
#pragma once

#include <cstddef>
#include <functional>
#include <tuple>
#include <utility>

namespace emu {

// How a block's threads run from now on: OS threads that run at the same time (the default), or
// fibers on the launching thread that switch where a thread waits, much faster where kernels
// synchronise often (see runtime.cpp).
void use_fibers(bool on);

// Whether a block's threads run as fibers now (`use_fibers`).
bool fibers_on();

// Runs `body` on every thread of every block of `grid` with `dynamic_shared` bytes of dynamic
// shared memory (see runtime.cpp).
void run_grid(const char* kernel, dim3 grid, dim3 block, std::size_t dynamic_shared,
              const std::function<void()>& body);

// The arguments are converted to the kernel's parameter types once, as the driver copies them,
// and every thread calls the kernel with its own copies (a kernel may modify its parameters).
// Runs `body` on the calling thread as the host stand-in of a launch of `kernel` (the fake
// driver's, see fake_driver/registry.h): the emulator's error reports name that kernel, as they
// do for run_grid's launches, and say no block or thread of it is running.
void run_on_host(const char* kernel, const std::function<void()>& body);

template <typename... P, typename... A>
void launch_shared(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, std::size_t dynamic_shared,
                   A&&... args) {
    static_assert(sizeof...(P) == sizeof...(A), "the kernel takes a different number of arguments");
    const std::tuple<P...> params(std::forward<A>(args)...);
    run_grid(name, grid, block, dynamic_shared, [&] { std::apply(kernel, params); });
}

template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) {
    launch_shared(name, kernel, grid, block, 0, std::forward<A>(args)...);
}

}  // namespace emu

#define EMU_LAUNCH(kernel, grid, block, ...) ::emu::launch(#kernel, kernel, grid, block, __VA_ARGS__)
#define EMU_LAUNCH_SHARED(kernel, grid, block, bytes, ...) \
    ::emu::launch_shared(#kernel, kernel, grid, block, bytes, __VA_ARGS__)
