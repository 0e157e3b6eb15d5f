// The sm_80+ instructions the tensor-core convolution is built on, as inline PTX: asynchronous
// global-to-shared copies (`cp.async`, so loads of the next K slices overlap the math of this
// one), `ldmatrix` (a warp loads its operand fragments from shared memory in one instruction),
// the bf16 `mma.sync` of shape m16n8k16 and the TF32 one of shape m16n8k8, both with f32
// accumulators, the conversion of f32 to TF32, and the block's dynamic shared memory. The kernel emulator
// (`cargo xtask kernels-emu`) defines VAE_KERNELS_EMULATOR and substitutes emulations with the
// same per-lane fragment layouts (emu/include/ptx_emu.h).
#pragma once

#ifdef VAE_KERNELS_EMULATOR
#include <ptx_emu.h>
#else

// The block's dynamic shared memory, which must hold `bytes`: a launch that gave less traps
// (the kernel would otherwise read and write past it).
__device__ __forceinline__ unsigned char* dynamic_shared(unsigned bytes) {
    extern __shared__ __align__(128) unsigned char dynamic_smem[];
    unsigned given;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(given));
    if (given < bytes) __trap();
    return dynamic_smem;
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes from global to shared memory, or 16 zero bytes when `full` is false (the source is
// then not read, but must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool full) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)), "l"(gmem),
                 "r"(full ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `N` of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 matrices of 16-bit elements; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

// c += a b for a 16x16 (row-major) by 16x8 (column-major) bf16 product, f32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// f32 -> TF32 (10 mantissa bits, rounded to nearest, ties away from zero), as 32-bit f32 bits
// whose low 13 bits are zero.
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// c += a b for a 16x8 (row-major) by 8x8 (column-major) TF32 product, f32 accumulators.
__device__ __forceinline__ void mma_tf32_1688(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#endif
