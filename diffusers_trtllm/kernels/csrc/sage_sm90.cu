// sage_sm90.cu: int8 SAGE attention with skip-softmax for Hopper (sm_90a), diffusers-trtllm's own kernel.
//
// What it computes is docs/design.md's "Semantics every route shares" with tiles of 64 query rows x 128
// keys: int8 Q and K with per-block scales (SAGE), fp8 e4m3 P (scaled by 448) and V (per-channel scales),
// the skip-softmax tile rule, ragged batches through cu_seqlens, GQA. The host side is
// kernels/sage_sm90.py; it compiles this file with NVRTC (nvcc where named) at first use (kernels/cuda_jit.py).
//
// Structure (FA3-style warp specialization): one CTA serves 128 query rows of one (sequence, head) with
// three warpgroups. Warpgroup 0 is the producer: one thread streams K and V^T tiles through TMA into a
// ring of shared-memory stages (mbarriers "full" and "empty" per stage) and one warp stages each key's
// K scale beside them. Warpgroups 1 and 2 are the consumers, 64 query rows each, each issuing its
// tensor-core work when ready (SAGE_SM90_PINGPONG=1 makes them take turns, FA3's ping-pong: 1-2% slower on
// the H200 since 2026-12-03, docs/design.md "What skip costs"), and each issues P.V of tile n together with
// Q.K^T of tile n + 1. SAGE_SM90_CONSUMERS=1 makes the CTA 64 query rows, the producer and one consumer (256
// threads), so that two CTAs share an SM: one's prologue, epilogue and last-wave tail beside the other's work.
//
// Persistent (SAGE_SM90_PERSISTENT, issue 57): the host launches min(work tiles, SMs x CTAS_PER_SM) CTAs, and CTA b
// runs the work tiles b, b + gridDim.x, ... (WorkTile: numbered by sequence, head, query tile, so that the CTAs
// running together share K and V in L2). The K/V ring's stages and phases count the CTA's KV tiles across its work
// tiles, and Q has two buffers (one where two do not fit beside the stages) with a full and an empty barrier each:
// the consumers hand Q back after a tile's last Q.K^T, so the next tile's Q and first KV tiles load while they
// finish the last P.V and store the output. One CTA per work tile (0) pays that prologue and epilogue with the SM
// otherwise idle, about 6 of Flux 1024 x 1024's 36 KV tiles a CTA, yet measured faster on an H100 (kernel alone
// 0.422 / 3.892 / 24.46 ms against 0.429 / 3.984 / 25.36 at 4,608 / 16,896 / 32,760 tokens: the static order's last
// round and the longer loop cost more than the hidden prologue saves; benchmarks/results/sage_sm90_persistent_h100.md),
// so it stays the default.
//
// Per KV tile a consumer: S = Q K^T (wgmma int8 -> int32); the row max over integers within each group of
// scores sharing a K scale, scaled once per group; the skip vote (one warpgroup-wide OR); p = 448 * 2^x
// with x one FFMA on S's exact float (about a quarter of them by a cubic on the FMA pipe, the rest on the
// transcendental unit, which would otherwise bound the kernel); P packed to fp8 in the register order the
// P.V wgmma reads as its A operand; O = O * alpha + P V^T (wgmma fp8 -> fp32; the rescale is left out
// while no row's max moved) and l = l * alpha + the tile's row sums (a small wgmma, see E4M3_ONES).
// O accumulates inside the tensor cores across tiles (13 mantissa bits per add), which biases it when every
// tile adds alike; V arrives less its per-channel mean (the quantizer's smooth_v), so the adds have random
// signs, and the epilogue adds the mean back (docs/design.md, "V's mean"). A second, per-tile accumulator
// (SageAttention2's two-level accumulation) would need 64 more registers than the consumers have.
//
// Register-order trick: the S accumulator gives thread (g, t) of a warp the columns {2t, 2t+1, 8+2t, 9+2t}
// of each 16 keys; the A fragment of a k32 fp8 wgmma wants columns {4t..4t+3}. Since P.V sums over keys,
// any order works as long as V^T's columns follow it: the quantizer stores V^T with the keys of every
// aligned group of 16 permuted (position 4t + 2h + e holds key 8h + 2t + e), so no shuffles are needed.
//
// Build knobs (-D): SAGE_SM90_STAGES (pipeline depth), SAGE_SM90_PINGPONG, SAGE_SM90_SOFT_EXP,
// SAGE_SM90_OVERLAP (FA3's intra-warpgroup overlap: Q.K^T of tile n + 1 and P.V of tile n in two commit
// groups, softmax of tile n + 1 beside the latter; 0: both in one group, waited for together),
// SAGE_SM90_CONSUMERS (consumer warpgroups a CTA, 2; 1: two CTAs an SM, each with 232 registers a consumer thread
// where two consumers have 240, and three stages where two have four, to fit; no PINGPONG; GPU-tested on an H200,
// and slower there than the default: benchmarks/results/sage_sm90_one_consumer_h200.md) and
// SAGE_SM90_HALF_POLY (the FMA-pipe exponentials two at a time in half precision, exp2_e4m3x2; 0: one at a
// time in fp32), SAGE_SM90_STAGE_OUT (the output rows through shared memory, stage_out), SAGE_SM90_PERSISTENT,
// SAGE_SM90_Q_BUFFERS (the persistent kernel's Q buffers, at most) and SAGE_SM90_RESCALE_SLACK (O rescaled only where
// a row's max passed the exponent's by more than it, in log2 units; 0, the default: wherever a max moved). The
// defaults are the fastest measured
// (benchmarks/results/sage_sm90_sweep_h200.md; SAGE_SM90_PERSISTENT's: above; SAGE_SM90_STAGE_OUT's: cta_cost_h100_*.md;
// SAGE_SM90_RESCALE_SLACK's: sage_sm90_slack_h100.md, 1 and 2 about 1% slower).
// SAGE_SM90_Q_BUFFERS's default, two, was not timed against one.

#ifndef SAGE_SM90_SOFT_EXP  // of each row's 16 score chunks, how many take exp2_poly (fast path)
#define SAGE_SM90_SOFT_EXP 4
#endif
#ifndef SAGE_SM90_CONSUMERS  // consumer warpgroups of 64 query rows a CTA: 2 (one CTA an SM) or 1 (two CTAs an SM)
#define SAGE_SM90_CONSUMERS 2
#endif
#ifndef SAGE_SM90_STAGES  // (one consumer: three, so that two CTAs fit in shared memory)
#define SAGE_SM90_STAGES (SAGE_SM90_CONSUMERS == 1 ? 3 : 4)
#endif
#ifndef SAGE_SM90_PINGPONG  // the consumers take turns issuing their products (1; 0: each issues when ready)
#define SAGE_SM90_PINGPONG 0
#endif
#ifndef SAGE_SM90_HALF_POLY  // the FMA-pipe exponentials two at a time in half precision (exp2_e4m3x2)
#define SAGE_SM90_HALF_POLY 1
#endif
#ifndef SAGE_SM90_OVERLAP  // FA3's intra-warpgroup overlap (softmax of tile n beside P.V of tile n - 1)
#define SAGE_SM90_OVERLAP 1
#endif
#ifndef SAGE_SM90_PERSISTENT  // one CTA per SM looping over the work tiles (1); 0: one CTA per work tile
#define SAGE_SM90_PERSISTENT 0
#endif
#ifndef SAGE_SM90_STAGE_OUT  // the output through shared memory where it fits (1); 0: stored from the registers
#define SAGE_SM90_STAGE_OUT 1
#endif
#ifndef SAGE_SM90_Q_BUFFERS  // Q buffers of the persistent kernel, at most (2: the next tile's Q loads early)
#define SAGE_SM90_Q_BUFFERS 2
#endif
#ifndef SAGE_SM90_RESCALE_SLACK  // how far (log2 units) a row's max may pass the exponent's before O is rescaled; 0: not at all
#define SAGE_SM90_RESCALE_SLACK 0
#endif

namespace sage_sm90 {

// Fixed-width integers (<stdint.h>'s names, declared here: NVRTC has no standard headers).
using int32_t = int;
using uint8_t = unsigned char;
using uint16_t = unsigned short;
using uint32_t = unsigned int;
using uint64_t = unsigned long long;
using uintptr_t = unsigned long long;
static_assert(sizeof(uint16_t) == 2 && sizeof(uint32_t) == 4 && sizeof(uint64_t) == 8 && sizeof(uintptr_t) == sizeof(void*),
              "fixed-width integers");

// The outputs' element types: the bits of a bf16 or an fp16 (no cuda_bf16.h / cuda_fp16.h needed).
struct Bf16 { uint16_t bits; };
struct Fp16 { uint16_t bits; };

constexpr int BLOCK_M = 64;    // query rows per consumer warpgroup: the skip rule's tile_q
constexpr int BLOCK_N = 128;   // keys per tile: tile_kv
constexpr int CONSUMERS = SAGE_SM90_CONSUMERS;
static_assert(CONSUMERS == 1 || CONSUMERS == 2, "SAGE_SM90_CONSUMERS is 1 or 2");
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int CTAS_PER_SM = CONSUMERS == 1 ? 2 : 1;  // resident together (__launch_bounds__, shared memory)
// Registers a thread after setmaxnreg: the producer warpgroup gives registers back to the CTA's pool and the consumers
// take them, so together they have at most what the CTA got at its launch: THREADS x ptxas's count a thread under
// __launch_bounds__ (the SM's 64K shared by CTAS_PER_SM CTAs, a multiple of 8). 232 x 128 + 24 x 128 is all of a
// one-consumer CTA's 32K.
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = CONSUMERS == 1 ? 232 : 240;
constexpr int LAUNCH_REGS = 65536 / (CTAS_PER_SM * THREADS) / 8 * 8;
static_assert(128 * (PRODUCER_REGS + CONSUMERS * CONSUMER_REGS) <= THREADS * LAUNCH_REGS,
              "setmaxnreg past the registers the CTA holds");
// Rescale slack (SAGE_SM90_RESCALE_SLACK = T, issue 57): a row's exponent is taken from a max u that moves only
// when the row's running max m passes it by more than T (log2 units), so O's rescale (64 multiplies a thread, on
// the path to the next products) is left out on most tiles; P is stored as 448 * 2^-T * p so that a score up to
// T past u still fits e4m3 (fp8's subnormals start T bits sooner). The vote keeps m, the exact running max.
constexpr float RESCALE_SLACK = SAGE_SM90_RESCALE_SLACK;
static_assert(RESCALE_SLACK >= 0.f && RESCALE_SLACK <= 4.f, "SAGE_SM90_RESCALE_SLACK is 0 to 4");
constexpr float LOG2_P_SCALE = 8.807354922057604f - RESCALE_SLACK;  // log2(448 * 2^-T): P is stored as 448 * 2^-T * p
constexpr float LN2 = 0.6931471805599453f;
constexpr float NEG_INF = __builtin_bit_cast(float, 0xff800000u);  // -inf, with no <cmath> to name it
constexpr float POS_INF = __builtin_bit_cast(float, 0x7f800000u);

// The driver's CUtensorMap, opaque: 128 bytes, 64-byte aligned (kernel parameters by value).
struct alignas(64) TensorMap { uint64_t opaque[16]; };

struct Params {
  void* out;               // [tokens_q, heads, D] bf16 or fp16
  const float* q_scale;    // [heads, n_q_blocks]
  const float* k_scale;    // [kv_heads, n_k_blocks] (with k_per_thread, four slots per block)
  const float* v_scale;    // [kv_heads, D]
  const float* v_mean;     // [kv_heads, D]: V's mean, taken off before fp8 and added back to the output
  const int* cu_q;         // [num_seqs + 1]
  const int* cu_kv;
  int* stats;              // skipped-tile counter (only written when count_skipped)
  float qk_scale_log2;     // softmax_scale * log2(e)
  float skip_factor;       // lambda = skip_factor / kv_len; 0: never skip
  int n_q_blocks;
  int n_k_blocks;
  long long out_stride_t;  // elements
  long long out_stride_h;
  int heads;
  int group;               // query heads per KV head
  int q_shift;             // log2(q_block_size)
  int k_shift;             // log2(k_block_size)
  int count_skipped;
  int k_per_thread;        // each K block has four scales, key j's being (j % 8) / 2: a quad lane's keys
  float* lse;              // [tokens_q, heads]: each row's natural log-sum-exp (ring attention); null: not asked
  int num_seqs;            // sequences in cu_q / cu_kv (the persistent kernel's schedule walks them)
};

template <bool B>
struct BoolConstant {
  static constexpr bool value = B;
  __device__ constexpr operator bool() const { return B; }
};

// ---- PTX wrappers -------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes));
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)));
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity));
}

// 2-D TMA load of one box at (c0 = inner, c1 = outer) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// OR of `want` over the 128 threads of one warpgroup (named barrier `id`).
__device__ __forceinline__ bool warpgroup_any(int id, bool want) {
  uint32_t out;
  asm volatile(
      "{\n.reg .pred pin, pout;\nsetp.ne.b32 pin, %1, 0;\n"
      "bar.red.or.pred pout, %2, 128, pin;\nselp.u32 %0, 1, 0, pout;\n}\n"
      : "=r"(out)
      : "r"(static_cast<uint32_t>(want)), "r"(id)
      : "memory");
  return out != 0;
}

__device__ __forceinline__ float max_nan(float a, float b) {  // NaN wins, as torch.amax
  float d;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// An output value in OutT, rounded to nearest even; fp16's range is clamped first, NaN kept: fp8's rounding of V
// less its mean can take an average of values at fp16's limit past it, where the average itself cannot be.
template <typename OutT>
__device__ __forceinline__ OutT to_output(float x);

template <>
__device__ __forceinline__ Bf16 to_output<Bf16>(float x) {
  Bf16 y;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(y.bits) : "f"(x));
  return y;
}

template <>
__device__ __forceinline__ Fp16 to_output<Fp16>(float x) {
  float clamped;
  asm("min.NaN.f32 %0, %1, 0f477FE000;\n" : "=f"(clamped) : "f"(max_nan(x, -65504.f)));  // 65504
  Fp16 y;
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(y.bits) : "f"(clamped));
  return y;
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe for x <= 9 (NaN stays NaN; below 2^-120 it is not 0 but as good as, once P is fp8):
// x = n + f with n = round(x), 2^f by a cubic on [-1/2, 1/2] (relative error 1e-4, far under fp8's 6%),
// and n added to the exponent bits.
__device__ __forceinline__ float exp2_poly(float x) {
  x = max_nan(x, -120.f);
  const float t = x + 12582912.0f;  // 1.5 * 2^23 + round(x) in the low mantissa bits
  const float f = x - (t - 12582912.0f);
  const float p = fmaf(f, fmaf(f, fmaf(f, 0.0555041086648216f, 0.2402265069591007f), 0.6931471805599453f), 1.0f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// Two floats to two e4m3 bytes, `lo` in the low byte (round to nearest even, saturating).
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  uint16_t q;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(q) : "f"(hi), "f"(lo));
  return q;
}

// e4m3 bytes of 2^lo and 2^hi (lo in the low byte) on the FMA pipe in half precision, two at a time
// (SAGE_SM90_HALF_POLY): x = n + f with n = round(x) (by adding 1536 = 1.5 * 2^10), 2^f by a quadratic on
// [-1/2, 1/2], times 2^n made from n's bits. Relative error under 5e-3 for x in [-14, 9], mean under 1e-3
// (tests/test_sage_sm90.py emulates it), against fp8's 6% rounding step after it. x is clamped to -14 first: 2^-14 is 0 in e4m3
// as well. For the fast path's finite exponents only (no NaN: its integer step would touch the other half).
__device__ __forceinline__ uint16_t exp2_e4m3x2(float lo, float hi) {
  constexpr uint32_t MINUS_14 = 0xCB00CB00u, F16_1536 = 0x66006600u, ONE = 0x3C003C00u;
  constexpr uint32_t C1 = 0x39A039A0u, C2 = 0x33AD33ADu;  // 0.703, 0.2399: 2^f ~ 1 + f (C1 + f C2)
  uint32_t x, t, n, f, p;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(x) : "f"(hi), "f"(lo));
  asm("max.f16x2 %0, %1, %2;\n" : "=r"(x) : "r"(x), "r"(MINUS_14));
  asm("add.rn.f16x2 %0, %1, %2;\n" : "=r"(t) : "r"(x), "r"(F16_1536));  // 1536 + round(x), exactly
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(n) : "r"(t), "r"(F16_1536));
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(f) : "r"(x), "r"(n));
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(p) : "r"(f), "r"(C2), "r"(C1));
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(p) : "r"(p), "r"(f), "r"(ONE));
  // 2^n per half: t's bits are 0x6600 + n, and (n + 15) << 10 is 2^n's; n + 15 in [1, 24] keeps each half
  // apart (no borrow, no carry), so one 32-bit multiply-add does both.
  const uint32_t pow2 = (t - 0x65F165F1u) * 1024u;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(p) : "r"(p), "r"(pow2));
  uint16_t q;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;\n" : "=h"(q) : "r"(p));
  return q;
}

// An int32 |x| < 2^22 as an exact float: adding 1.5 * 2^23's bit pattern places x in the mantissa. An
// integer add and a float add, where cvt (I2FP) would take the transcendental unit the exponentials need.
__device__ __forceinline__ float exact_float(int32_t x) { return __int_as_float(x + 0x4B400000) - 12582912.0f; }

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// 16 bytes from shared memory to global memory (both 16-byte aligned).
__device__ __forceinline__ void copy_shared_to_global_16(void* dst, uint32_t src) {
  uint32_t a, b, c, d;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(src) : "memory");
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}

// The larger of two scores: floats NaN-propagating (as torch.amax), integers plain.
__device__ __forceinline__ float larger(float a, float b) { return max_nan(a, b); }
__device__ __forceinline__ int32_t larger(int32_t a, int32_t b) { return max(a, b); }

// The max of N values (N a power of two) in log2(N) dependent steps (a chain would take N - 1).
template <typename T, int N>
__device__ __forceinline__ T tree_max(const T (&r)[N]) {
  if constexpr (N == 1) {
    return r[0];
  } else {
    T half[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j) half[j] = larger(r[j], r[j + N / 2]);
    return tree_max(half);
  }
}

// (old & zero) | value in one LOP3: `value`, read together with `old` so that `old` stays alive until here.
__device__ __forceinline__ uint32_t keep_alive_copy(uint32_t old, uint32_t zero, uint32_t value) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(old), "r"(zero), "r"(value));  // (a & b) | c
  return d;
}

// Shared-memory matrix descriptor of a K-major tile whose rows are `row_bytes` long (64 or 128), swizzled
// by the same width (what TMA wrote): 8-row groups are 8 * row_bytes apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, int row_bytes) {
  const uint64_t swizzle = row_bytes == 128 ? 1 : 2;  // 1: 128B, 2: 64B
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) |
         (static_cast<uint64_t>((8 * row_bytes) >> 4) << 32) | (swizzle << 62);
}

// A descriptor `units` 16-byte steps further on: the start address is the low 14 bits, and shared memory (under
// 2^18 bytes) never carries out of them, so one 32-bit add on the low word does where a 64-bit add takes two.
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t units) {
  uint64_t d;
  asm("{\n.reg .b32 lo, hi;\nmov.b64 {lo, hi}, %1;\nadd.u32 lo, lo, %2;\nmov.b64 %0, {lo, hi};\n}\n"
      : "=l"(d) : "l"(desc), "r"(units));
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed groups of this warpgroup's products are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Keep the compiler from moving accesses of an accumulator across the asynchronous products.
template <int N>
__device__ __forceinline__ void fence_operand(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}

template <int N>
__device__ __forceinline__ void fence_operand(int32_t (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(x[i])::"memory");
}

template <int N, int M>
__device__ __forceinline__ void fence_operand(uint32_t (&x)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
  }
}

__device__ __forceinline__ void setmaxnreg_producer() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
}
__device__ __forceinline__ void setmaxnreg_consumer() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
}

// D (+)= A * B^T, A (Q) and B (K) int8 in shared memory, K-major; D int32 [64 x 128]. ACCUMULATE false
// overwrites D (write-only operands, so the compiler keeps no stale values alive).
template <bool ACCUMULATE>
__device__ __forceinline__ void wgmma_s8_m64n128k32(int32_t (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (ACCUMULATE) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]), "=r"(d[8]), "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15]), "=r"(d[16]), "=r"(d[17]), "=r"(d[18]), "=r"(d[19]), "=r"(d[20]), "=r"(d[21]), "=r"(d[22]), "=r"(d[23]), "=r"(d[24]), "=r"(d[25]), "=r"(d[26]), "=r"(d[27]), "=r"(d[28]), "=r"(d[29]), "=r"(d[30]), "=r"(d[31]), "=r"(d[32]), "=r"(d[33]), "=r"(d[34]), "=r"(d[35]), "=r"(d[36]), "=r"(d[37]), "=r"(d[38]), "=r"(d[39]), "=r"(d[40]), "=r"(d[41]), "=r"(d[42]), "=r"(d[43]), "=r"(d[44]), "=r"(d[45]), "=r"(d[46]), "=r"(d[47]), "=r"(d[48]), "=r"(d[49]), "=r"(d[50]), "=r"(d[51]), "=r"(d[52]), "=r"(d[53]), "=r"(d[54]), "=r"(d[55]), "=r"(d[56]), "=r"(d[57]), "=r"(d[58]), "=r"(d[59]), "=r"(d[60]), "=r"(d[61]), "=r"(d[62]), "=r"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(0));
  }
}

// D (+)= A * B^T, A (P) fp8 e4m3 in registers, B (V^T) fp8 e4m3 in shared memory, K-major; D fp32 [64 x 128].
template <bool ACCUMULATE>
__device__ __forceinline__ void wgmma_e4m3_m64n128k32(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (ACCUMULATE) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(0));
  }
}

// D (+)= A * B^T, A (P) fp8 e4m3 in registers, B (V^T) fp8 e4m3 in shared memory, K-major; D fp32 [64 x 64].
template <bool ACCUMULATE>
__device__ __forceinline__ void wgmma_e4m3_m64n64k32(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (ACCUMULATE) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(0));
  }
}

// D (+)= A * B^T, A (P) fp8 e4m3 in registers, B (V^T) fp8 e4m3 in shared memory, K-major; D fp32 [64 x 8].
template <bool ACCUMULATE>
__device__ __forceinline__ void wgmma_e4m3_m64n8k32(float (&d)[4], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (ACCUMULATE) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(0));
  }
}

// Row sums of P by the tensor cores: below every stage's V^T tile sit 8 more rows, the first all ones (e4m3
// 1.0) and the rest zeros, and a k32 product of P with them (N = 8) gives each row's sum in column 0. It
// runs into a fresh accumulator per tile and is added to l in fp32: accumulated across tiles inside the
// tensor cores, whose fp8 products keep fewer bits than fp32, the sums came out biased (rel-L1 0.043 / 0.068
// against 0.033 on wan_14b_480p / 720p, H200).
constexpr uint32_t E4M3_ONES = 0x38383838u;

template <int D>
__device__ __forceinline__ void wgmma_pv(float (&d)[D / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (D == 128) {
    wgmma_e4m3_m64n128k32<true>(d, a, desc_b);
  } else {
    wgmma_e4m3_m64n64k32<true>(d, a, desc_b);
  }
}

// S = Q K^T for one KV tile: D / 32 products of k32.
template <int D>
__device__ __forceinline__ void issue_qk(int32_t (&acc)[64], uint64_t desc_q, uint64_t desc_k) {
  wgmma_s8_m64n128k32<false>(acc, desc_q, desc_k);
#pragma unroll
  for (int kk = 1; kk < D / 32; ++kk) {
    wgmma_s8_m64n128k32<true>(acc, desc_plus(desc_q, 2 * kk), desc_plus(desc_k, 2 * kk));
  }
}

// O += P V for one KV tile: 128 keys in four k32 products.
template <int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pa)[4][4], uint64_t desc_v) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_pv<D>(o, pa[kk], desc_plus(desc_v, 2 * kk));
}

// The tile's row sums of P (fresh), by four k32 products with the ones row.
__device__ __forceinline__ void issue_row_sums(float (&sums)[4], const uint32_t (&pa)[4][4], uint64_t desc_ones) {
  wgmma_e4m3_m64n8k32<false>(sums, pa[0], desc_ones);
#pragma unroll
  for (int kk = 1; kk < 4; ++kk) wgmma_e4m3_m64n8k32<true>(sums, pa[kk], desc_plus(desc_ones, 2 * kk));
}

// ---- shared memory ------------------------------------------------------------------------------------

// A row of the output staged in shared memory: D values of 2 bytes, then 16 bytes of padding, so that both the
// consumers' 4-byte writes (8 rows x 4 lanes a warp) and the 16-byte reads of whole rows fall on 32 distinct banks.
__host__ __device__ constexpr int out_row_bytes(int d) { return 2 * d + 16; }
// A consumer's staged output: its rows, then V's channel scales and means (D floats each), read by the epilogue.
__host__ __device__ constexpr int out_stage_bytes(int d) { return BLOCK_M * out_row_bytes(d) + 2 * d * 4; }

template <int BYTES>
struct alignas(16) Bytes { uint8_t bytes[BYTES]; };
template <>
struct Bytes<0> {};

template <int D, int STAGES, int Q_BUFS, bool STAGE_OUT>
struct Smem {
  uint8_t q[Q_BUFS][CONSUMERS * BLOCK_M * D];  // rows of D bytes, D-byte swizzle
  uint8_t k[STAGES][BLOCK_N * D];      // rows of D bytes
  uint8_t v[STAGES][(D + 8) * BLOCK_N];  // V^T tile: D rows of 128 keys (128-byte swizzle), then ones, zeros
  float k_scale[STAGES][BLOCK_N];      // each key's scale, staged by the producer
  Bytes<STAGE_OUT ? CONSUMERS * out_stage_bytes(D) : 0> out;  // each consumer's output rows and V's stats
  uint64_t full_q[Q_BUFS];
  uint64_t empty_q[Q_BUFS];            // the consumers are done with the buffer's Q (persistent kernel only)
  uint64_t full_k[STAGES];             // K tile (TMA) and its scales (32 producer lanes)
  uint64_t full_v[STAGES];
  uint64_t empty[STAGES];
};

// Dynamic shared memory a CTA may have on sm_90 with CTAS_PER_SM of them resident: 227 KB alone, else a share of the
// SM's 228 KB less the 1 KB the system reserves per CTA.
constexpr int MAX_SMEM = CTAS_PER_SM == 1 ? 227 * 1024 : 228 * 1024 / CTAS_PER_SM - 1024;

// Whether the output goes out through shared memory (where its rows fit beside the stages; the one-consumer build's
// do not): the consumers write their rows there, then copy whole rows out in 16-byte stores, where stores from the
// accumulator's registers write 4 bytes of 8 rows at a time (half sectors) and the CTA's exit waits on them.
template <int D, int STAGES>
__host__ __device__ constexpr bool stage_out() {
  return SAGE_SM90_STAGE_OUT && sizeof(Smem<D, STAGES, 1, true>) + 1024 <= MAX_SMEM;
}

// Q buffers: one per CTA, or in the persistent kernel up to SAGE_SM90_Q_BUFFERS where they fit beside the stages.
template <int D, int STAGES, bool PERSISTENT>
__host__ __device__ constexpr int q_buffers() {
  return PERSISTENT && SAGE_SM90_Q_BUFFERS >= 2 && sizeof(Smem<D, STAGES, 2, stage_out<D, STAGES>()>) + 1024 <= MAX_SMEM
             ? 2 : 1;
}

template <int D, int STAGES, bool PERSISTENT>
__host__ __device__ constexpr int smem_bytes() {  // + alignment slack
  return static_cast<int>(sizeof(Smem<D, STAGES, q_buffers<D, STAGES, PERSISTENT>(), stage_out<D, STAGES>()>)) + 1024;
}

// G, the scores of a thread's row that share one K scale, for a K block size: a thread holds keys {2t, 2t + 1,
// 8 + 2t, 9 + 2t} of every 16, so blocks of 1 give each score its own, 4 a pair, 16 four, 128 all 32.
__host__ __device__ constexpr int scores_per_k_scale(int k_block) { return k_block == 1 ? 1 : k_block == 4 ? 2 : k_block == 16 ? 4 : 32; }

// 16 values of P (accumulator chunks 4kk..4kk+3) as the k32 A fragment of the P.V product, from their e4m3
// pairs: q[j] holds values 2j and 2j + 1.
__device__ __forceinline__ void pack_p_pairs(uint32_t (&a)[4], const uint16_t (&q)[8]) {
  a[0] = q[0] | (static_cast<uint32_t>(q[2]) << 16);
  a[1] = q[1] | (static_cast<uint32_t>(q[3]) << 16);
  a[2] = q[4] | (static_cast<uint32_t>(q[6]) << 16);
  a[3] = q[5] | (static_cast<uint32_t>(q[7]) << 16);
}

// The same from the 16 values in fp32.
__device__ __forceinline__ void pack_p(uint32_t (&a)[4], const float (&x)[16]) {
  uint16_t q[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) q[j] = e4m3x2(x[2 * j], x[2 * j + 1]);
  pack_p_pairs(a, q);
}

// Accumulator index of a thread's e-th score of row r (e in [0, 32): chunk e / 2, column e % 2).
__device__ __forceinline__ constexpr int acc_index(int r, int e) { return 4 * (e / 2) + 2 * r + e % 2; }
// Key (within the tile) of a thread's e-th score: chunk e / 2 covers keys 8 (e / 2) .. + 7.
__device__ __forceinline__ int key_of(int e, int t) { return 8 * (e / 2) + 2 * t + e % 2; }

// Softmax of one tile, from S (int32) to P (fp8, in the P.V product's register order).
//
// G consecutive scores of a thread's row share one K scale (k_block_size 128: G = 32; 16: 4; 4: 2; 1: 1),
// so the row max is taken over integers within each group and scaled once per group, and the exponent is
// one FFMA per score on S's exact float: 2^(S * c + b) with c = k_scale * q_scale' and b folding in the max
// (fast path). Rows whose magnitudes make that rounding matter (|m * qs| >= 2^12 or c >= 2^-8), and the
// ragged last tile (MASKED: keys past the sequence are -inf), take the exact path: s = S * k_scale rounded
// once, then 2^((s - m) * qs), which is exactly 2^0 at the maximum whatever the magnitude.
//
// Returns whether the tile is kept (the skip vote, when `vote`); alpha is each row's rescale of O. m is each row's
// running max (the vote's), u the exponent's (m itself without RESCALE_SLACK).
template <int G, bool MASKED, bool SKIP>
__device__ __forceinline__ bool tile_softmax(const int32_t (&acc)[64], uint32_t k_scale_addr, int t, int keys_left,
                                             bool vote, int vote_barrier, float reach0, float reach1,
                                             float qs0, float qs1, float& m_0, float& m_1, float& u_0, float& u_1,
                                             float& alpha0, float& alpha1, uint32_t (&pa)[4][4]) {
  constexpr int NG = 32 / G;  // groups per row
  float ks_max = 0.f;

  // Row maxima: per group over integers (exact), scaled once; -inf past the keys in a ragged tile.
  constexpr int NM = NG < 16 ? NG : 16;  // partial maxima per row (G == 1 pairs its groups)
  float gm[2][NM];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      const float k = ld_shared_f32(k_scale_addr + 4 * key_of(G * g, t));
      if (r == 0) ks_max = fmaxf(ks_max, k);
      if constexpr (MASKED || G == 1) {
        float best = NEG_INF;
#pragma unroll
        for (int e = G * g; e < G * (g + 1); ++e) {
          const float s = (MASKED && key_of(e, t) >= keys_left) ? NEG_INF : __fmul_rn(exact_float(acc[acc_index(r, e)]), k);
          best = max_nan(best, s);
        }
        if constexpr (NG == 32) {
          if (g % 2 == 0) gm[r][g / 2] = best; else gm[r][g / 2] = max_nan(gm[r][g / 2], best);
        } else {
          gm[r][g] = best;
        }
      } else {
        int32_t group[G];
#pragma unroll
        for (int e = 0; e < G; ++e) group[e] = acc[acc_index(r, G * g + e)];
        gm[r][g] = __fmul_rn(exact_float(tree_max(group)), k);
      }
    }
  }
  float mx0 = tree_max(gm[0]), mx1 = tree_max(gm[1]);
  // Skip when exp(local max - running max) < lambda on every row of the tile, that is when each row's max is
  // under its running max plus its reach (log2 lambda over the row's scale, in the scores' units; +inf for a row
  // past the sequence): one add and one comparison a row (docs/design.md, "The vote's bound in the scores'
  // units"). A row is kept when any of its scores reaches the bound, so each thread votes on its own part of its
  // rows: the same OR, with the quad's shuffles below off the vote's path (a skipped tile 2-4% faster:
  // docs/design.md, "What a skipped tile costs, continued"). NaN keeps the tile.
  const bool want = !(mx0 < m_0 + reach0) || !(mx1 < m_1 + reach1);
  // A row's 128 keys are spread over the 4 lanes t of its quad.
  mx0 = max_nan(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
  mx0 = max_nan(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
  mx1 = max_nan(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
  mx1 = max_nan(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
  if (SKIP && vote) {
    // The warpgroup's OR, then a warp vote of it: the same value, but one the compiler can see is uniform
    // across the warp, so the tensor-core instructions under it are not serialized.
    const bool keep = __any_sync(0xffffffff, warpgroup_any(vote_barrier, want));
    if (!keep) return false;
  }
  const float mn0 = max_nan(m_0, mx0), mn1 = max_nan(m_1, mx1);
  const float old0 = RESCALE_SLACK > 0.f ? u_0 : m_0, old1 = RESCALE_SLACK > 0.f ? u_1 : m_1;
  // The exponent's max moves to the running max once that passes it by more than the slack (always without slack;
  // on the first tile and on NaN the comparison fails, so it moves).
  const float un0 = RESCALE_SLACK > 0.f && (mn0 - old0) * qs0 <= RESCALE_SLACK ? old0 : mn0;
  const float un1 = RESCALE_SLACK > 0.f && (mn1 - old1) * qs1 <= RESCALE_SLACK ? old1 : mn1;
  const float mu[2] = {un0 == NEG_INF ? 0.f : un0, un1 == NEG_INF ? 0.f : un1};
  const float qs[2] = {qs0, qs1};
  alpha0 = exp2_approx((old0 - mu[0]) * qs0);
  alpha1 = exp2_approx((old1 - mu[1]) * qs1);
  m_0 = mn0;
  m_1 = mn1;
  u_0 = un0;
  u_1 = un1;

  const bool fast = !MASKED && fabsf(mu[0] * qs0) < 4096.f && fabsf(mu[1] * qs1) < 4096.f &&
                    ks_max * fmaxf(qs0, qs1) < 0.00390625f;
  const bool all_fast = __all_sync(0xffffffff, fast);
  const float base[2] = {fmaf(-mu[0], qs0, LOG2_P_SCALE), fmaf(-mu[1], qs1, LOG2_P_SCALE)};
  // In the order the P.V product reads P: keys 32kk..32kk+31 are accumulator chunks 4kk..4kk+3, so each
  // group of 16 values is packed as soon as it is made (the K scales are read again, not kept).
  if (all_fast) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int idx = 16 * kk + i, r = (idx % 4) / 2, e = 2 * (idx / 4) + idx % 2;
        const float c = ld_shared_f32(k_scale_addr + 4 * key_of(G * (e / G), t)) * qs[r];
        const float b = fmaf(-12582912.0f, c, base[r]);  // S's float below is S + 1.5 * 2^23
        const float y = fmaf(__int_as_float(acc[idx] + 0x4B400000), c, b);
        if constexpr (SAGE_SM90_HALF_POLY) {
          x[i] = y;  // exponentiated in pairs below
        } else {
          x[i] = (idx / 4 < SAGE_SM90_SOFT_EXP) ? exp2_poly(y) : exp2_approx(y);
        }
      }
      if constexpr (SAGE_SM90_HALF_POLY) {
        uint16_t q[8];  // q[j]: values 2j and 2j + 1
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          q[j] = (16 * kk + 2 * j) / 4 < SAGE_SM90_SOFT_EXP ? exp2_e4m3x2(x[2 * j], x[2 * j + 1])
                                                          : e4m3x2(exp2_approx(x[2 * j]), exp2_approx(x[2 * j + 1]));
        }
        pack_p_pairs(pa[kk], q);
      } else {
        pack_p(pa[kk], x);
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int idx = 16 * kk + i, r = (idx % 4) / 2, e = 2 * (idx / 4) + idx % 2;
        const float k = ld_shared_f32(k_scale_addr + 4 * key_of(G * (e / G), t));
        const float sc = (MASKED && key_of(e, t) >= keys_left) ? NEG_INF : __fmul_rn(exact_float(acc[idx]), k);
        x[i] = exp2_approx(fmaf(sc - mu[r], qs[r], LOG2_P_SCALE));
      }
      pack_p(pa[kk], x);
    }
  }
  return true;
}

// ---- work tiles ---------------------------------------------------------------------------------------

// A CTA's unit of work: CONSUMERS x 64 query rows (from m0) of one (sequence, head) against all of the sequence's
// keys, and in the persistent kernel where it stands in the schedule.
//
// The persistent schedule (SAGE_SM90_PERSISTENT) numbers the work tiles sequence by sequence, head by head, query tile
// by query tile, so that the CTAs running at one time mostly share a (sequence, head) and its K and V in L2; a
// sequence without queries or without keys has no tiles. CTA b takes tiles b, b + gridDim.x, ... Each role (the TMA
// thread, the K-scale warp, every consumer thread) walks the schedule on its own, alike: they agree on every tile
// and on its KV tiles without a word. The cursor only moves forward, a few loads of cu_q / cu_kv and a division a
// tile; it keeps few registers (first, w) besides the tile's own, the consumers having few to spare.
struct WorkTile {
  int seq, head, m0;
  int q_start, q_len, kv_start, kv_len;
  int w, first;  // persistent: this tile's number, and that of its sequence's first tile

  __device__ __forceinline__ void load_seq(const Params& p) {
    q_start = p.cu_q[seq];
    q_len = p.cu_q[seq + 1] - q_start;
    kv_start = p.cu_kv[seq];
    kv_len = p.cu_kv[seq + 1] - kv_start;
  }
  // Tile w's sequence, head and rows; false past the last tile. Only seq, first and w carry over from the last
  // tile (the sequence's bounds are read again: fewer registers, where the producer has 24).
  __device__ __forceinline__ bool find(const Params& p) {
    for (;;) {
      load_seq(p);
      const int per_head = kv_len > 0 ? (q_len + CONSUMERS * BLOCK_M - 1) / (CONSUMERS * BLOCK_M) : 0;
      const int local = w - first;
      if (local < p.heads * per_head) {
        head = local / per_head;
        m0 = (local - head * per_head) * (CONSUMERS * BLOCK_M);
        return true;
      }
      first += p.heads * per_head;
      if (++seq >= p.num_seqs) return false;
    }
  }
  // This CTA's first tile; false: none (the whole CTA returns before any barrier is used).
  template <bool PERSISTENT>
  __device__ __forceinline__ bool start(const Params& p) {
    if constexpr (PERSISTENT) {
      w = blockIdx.x;
      seq = first = 0;
      return find(p);
    } else {  // the grid's (query tile, sequence x head)
      seq = blockIdx.y / p.heads;
      head = blockIdx.y % p.heads;
      m0 = blockIdx.x * (CONSUMERS * BLOCK_M);
      load_seq(p);
      return m0 < q_len && kv_len > 0;  // no keys: nothing defined to write (the host never launches such a batch)
    }
  }
  // This CTA's next tile; false: done.
  template <bool PERSISTENT>
  __device__ __forceinline__ bool next(const Params& p) {
    if constexpr (PERSISTENT) {
      w += gridDim.x;
      return find(p);
    } else {
      return false;
    }
  }
  __device__ __forceinline__ int n_tiles() const { return (kv_len + BLOCK_N - 1) / BLOCK_N; }  // KV tiles
};

// ---- the kernel ---------------------------------------------------------------------------------------

// The consumer warpgroups' part of the kernel (one branch of the role split, so that setmaxnreg can
// give it CONSUMER_REGS registers a thread).
template <int D, int STAGES, int QB, bool STAGE_OUT, int G, bool SKIP, bool PINGPONG, bool OVERLAP, bool PERSISTENT,
          typename OutT>
__device__ __forceinline__ void consume(Smem<D, STAGES, QB, STAGE_OUT>& sm, const Params& p, int consumer) {
  setmaxnreg_consumer();
  WorkTile tile;
  tile.start<PERSISTENT>(p);  // (found again here: values live across the role split cost registers on both sides)
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  // The ones and zeros below every stage's V^T tile (TMA writes only its D rows), visible to the tensor
  // cores (async proxy) before any P.V product. Once per CTA: TMA never writes them.
  {
    const int i = consumer * 128 + tid;  // 64 threads x 16 bytes a stage's 1 KB: 2 stages a consumer at a time
    for (int s = i / 64; s < STAGES; s += 2 * CONSUMERS) {
      const int offset = (i % 64) * 16;
      const uint32_t word = offset < BLOCK_N ? E4M3_ONES : 0u;
      *reinterpret_cast<uint4*>(sm.v[s] + D * BLOCK_N + offset) = make_uint4(word, word, word, word);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_sync(5, 128 * CONSUMERS);
  }

  // Descriptors: this consumer's Q, and each stage's K, V^T and the ones row below V^T, made once and moved on
  // by 32-bit adds. Made anew for every product from generic pointers, their 64-bit masks and adds cost 1.2-1.6%
  // at 40% of tiles skipped, and NVRTC (64-bit shared pointers) more than nvcc: docs/design.md, "Compiling
  // where users run it" and "What a skipped tile costs, continued".
  const uint64_t desc_q0 = desc_plus(smem_desc(smem_addr(sm.q[0]), D), consumer * (BLOCK_M * D / 16));
  const uint64_t desc_k0 = smem_desc(smem_addr(sm.k[0]), D), desc_v0 = smem_desc(smem_addr(sm.v[0]), 128);
  auto desc_k = [&](uint32_t s) { return desc_plus(desc_k0, s * (sizeof(sm.k[0]) / 16)); };
  auto desc_v = [&](uint32_t s) { return desc_plus(desc_v0, s * (sizeof(sm.v[0]) / 16)); };
  auto desc_ones = [&](uint32_t s) { return desc_plus(desc_v(s), D * BLOCK_N / 16); };
  // The CTA's KV tile c (counted over all its work tiles: the ring's position): its K (with its scales) or V^T has
  // landed in stage c % STAGES.
  auto wait_k = [&](uint32_t c) { mbar_wait(&sm.full_k[c % STAGES], (c / STAGES) & 1); };
  auto wait_v = [&](uint32_t c) { mbar_wait(&sm.full_v[c % STAGES], (c / STAGES) & 1); };
  // PINGPONG: the consumers take turns issuing their products (named barriers 1 and 2), so one's softmax
  // runs while the other's matrix products do; the first consumer goes first. Both take as many turns on every
  // work tile, so the turns carry on from one to the next.
  const int my_turn = 1 + consumer, their_turn = 2 - consumer;
  const int vote_barrier = 3 + consumer;
  if (PINGPONG && consumer == 1) named_arrive(1, 256);

  uint32_t base = 0;  // KV tiles of this CTA's earlier work tiles
  // One work tile, the CTA's it-th: called once, or in the persistent kernel in a loop over the CTA's tiles.
  auto run_tile = [&](uint32_t it) {
    const int seq = tile.seq, head = tile.head, kv_head = head / p.group;
    const int q_start = tile.q_start, q_len = tile.q_len, kv_len = tile.kv_len;
    // Through a shuffle from lane 0, as warpgroup: uniform, so the ring's stages and the descriptors stay uniform.
    const int n_tiles = __shfl_sync(0xffffffff, tile.n_tiles(), 0);
    const uint32_t qb = it % QB;
    const int wg_first_row = tile.m0 + consumer * BLOCK_M;
    const bool wg_has_rows = wg_first_row < q_len;
    const int row0 = wg_first_row + warp * 16 + g, row1 = row0 + 8;
    const bool ok0 = row0 < q_len, ok1 = row1 < q_len;

    const float* q_scale = p.q_scale + head * p.n_q_blocks + (q_start >> p.q_shift) + seq;
    const float qs0 = q_scale[min(row0, q_len - 1) >> p.q_shift] * p.qk_scale_log2;
    const float qs1 = q_scale[min(row1, q_len - 1) >> p.q_shift] * p.qk_scale_log2;
    // The vote's reach of each row (tile_softmax): log2 lambda (-inf when skip_factor == 0) over the row's scale.
    const float log2_lam = log2f(p.skip_factor / static_cast<float>(kv_len));
    const float reach0 = ok0 ? log2_lam / qs0 : POS_INF, reach1 = ok1 ? log2_lam / qs1 : POS_INF;
    const uint64_t desc_q = desc_plus(desc_q0, qb * (sizeof(sm.q[0]) / 16));
    // STAGE_OUT: V's channel scales and means to shared memory now, while Q and the first K load, so that the epilogue
    // reads them there (its global loads were a CTA's last wait); published by the epilogue's first barrier.
    const uint32_t out_stage = STAGE_OUT ? smem_addr(&sm.out) + consumer * out_stage_bytes(D) : 0;
    const uint32_t v_stats = out_stage + BLOCK_M * out_row_bytes(D);
    if constexpr (STAGE_OUT) {
      for (int i = tid; i < 2 * D; i += 128) {
        const float* stat = i < D ? p.v_scale + kv_head * D + i : p.v_mean + kv_head * D + i - D;
        st_shared_b32(v_stats + 4 * i, __float_as_uint(__ldg(stat)));
      }
    }
    // Once this tile's last Q.K^T is done, its Q buffer is the producer's again (persistent: the next tile's Q).
    auto release_q = [&] {
      if constexpr (PERSISTENT) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&sm.empty_q[qb]);
      }
    };

    float o[D / 2], sums[4];  // sums[0] / sums[2]: rows g / g + 8 of the tile (at t == 0; 0 elsewhere)
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m_0 = NEG_INF, m_1 = NEG_INF, u_0 = NEG_INF, u_1 = NEG_INF, l_0 = 0.f, l_1 = 0.f;
    int skipped = 0;
    int32_t acc[64];
    uint32_t pa[4][4];  // P of the tile being made

    mbar_wait(&sm.full_q[qb], (it / QB) & 1);
    wait_k(base);
    if (PINGPONG) named_sync(my_turn, 256);
    wgmma_fence();
    issue_qk<D>(acc, desc_q, desc_k(base % STAGES));
    wgmma_commit();
    if (PINGPONG) named_arrive(their_turn, 256);
    wgmma_wait<0>();
    fence_operand(acc);

    // Softmax of KV tile c (S in acc) into pa (the ragged last tile masked): whether the tile is kept, and each
    // row's rescale of O. A tile before the last is never ragged: ragged_tag false builds no masked variant for it.
    auto softmax = [&](uint32_t c, bool vote, auto ragged_tag, float& alpha0, float& alpha1) {
      const int keys_left = kv_len - static_cast<int>(c - base) * BLOCK_N;
      const uint32_t k_scale_addr = smem_addr(sm.k_scale[c % STAGES]);
      return decltype(ragged_tag)::value && keys_left < BLOCK_N
          ? tile_softmax<G, true, SKIP>(acc, k_scale_addr, t, keys_left, vote, vote_barrier, reach0, reach1, qs0,
                                        qs1, m_0, m_1, u_0, u_1, alpha0, alpha1, pa)
          : tile_softmax<G, false, SKIP>(acc, k_scale_addr, t, keys_left, vote, vote_barrier, reach0, reach1, qs0,
                                         qs1, m_0, m_1, u_0, u_1, alpha0, alpha1, pa);
    };
    auto rescale_o = [&](float alpha0, float alpha1) {
      if (__any_sync(0xffffffff, alpha0 != 1.f || alpha1 != 1.f)) {  // no rescale while the maxima hold
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] *= (i % 4) < 2 ? alpha0 : alpha1;
      }
    };

    if constexpr (OVERLAP) {
      uint32_t pv[4][4];      // P of the tile whose P.V product is in flight
      // ptxas takes P.V's P registers as free once the product is issued and reuses them in the next softmax
      // while the product still reads them (wrong results, measured). Reading the old pv after the wait, in
      // a copy masked by a zero it cannot prove (kv_len >= 0), keeps them alive until then: 16 LOP3 a tile
      // (keep_alive_copy; written as C++, (old & zero) | new took two each).
      const uint32_t zero = static_cast<uint32_t>(kv_len >> 31);
      bool sums_due = false;  // the P.V group in flight is a kept tile's: add its row sums to l
      // Once P.V of tile c - 1 is done (waited for), its stage is free; and O, its row sums and pv (retire_pv).
      auto release_stage = [&](uint32_t c, bool first) {  // of tile c - 1
        if (!first) {
          __syncwarp();
          if (lane == 0) mbar_arrive(&sm.empty[(c - 1) % STAGES]);
        }
      };
      auto retire_pv = [&](uint32_t c, bool first) {
        fence_operand(o);
        fence_operand(sums);
        fence_operand(pv);
        if (sums_due) {
          l_0 += sums[0];
          l_1 += sums[2];
        }
        release_stage(c, first);
      };
      // Per tile c (FA3's intra-warpgroup overlap): softmax of tile c runs while the tensor cores finish P.V of
      // tile c - 1; then Q.K^T of tile c + 1 and P.V of tile c are issued, in that order and as two commit
      // groups, so that the next softmax waits for the former only. The last tile (no Q.K^T to issue) is the
      // same step with MORE false. The work tile's first KV tile (no vote, no P.V in flight) is a step of its own,
      // first_tag a BoolConstant there and in the loop, and a step with MORE is never ragged, so the loop carries
      // neither the test for the first tile nor the masked softmax (1.3-1.5% faster, 2-5% with tiles skipped:
      // docs/design.md, "Tile 0 out of the loop"). The last step's first_tag is a bool: it is the first too when it is
      // the only one.
      auto step = [&](uint32_t c, auto more_tag, auto first_tag) {  // unsigned: stage and phase by masks and shifts
        constexpr bool MORE = decltype(more_tag)::value;
        const bool first = first_tag;
        const uint32_t s = c % STAGES;
        if (first) wgmma_wait<0>(); else wgmma_wait<1>();  // Q.K^T of tile c is done
        fence_operand(acc);
        if constexpr (!MORE) release_q();  // (its last Q.K^T)
        float alpha0, alpha1;
        const bool keep = softmax(c, !first, BoolConstant<!MORE>{}, alpha0, alpha1);
        auto issue_next_qk = [&] {
          wgmma_fence();
          issue_qk<D>(acc, desc_q, desc_k((c + 1) % STAGES));
          wgmma_commit();
        };
        if (SKIP && !PINGPONG && STAGES > 2 && MORE && !keep) {
          // Skipped: S of tile c is dead, so Q.K^T of tile c + 1 goes to the tensor cores now, behind P.V of
          // tile c - 1 where that still runs (all skipped 4-6% faster, about 40% skipped 1-2%:
          // docs/design.md, "Issuing the next Q.K^T first"), and an empty group after it keeps the next step's
          // wait the same. P.V's row sums wait for the next step's retire_pv (no product writes them before):
          // reading them or O here, with Q.K^T in flight, makes ptxas serialize every product (C7514). With two
          // stages, tile c + 1's K goes where tile c - 1's V is, so it cannot land before that stage is free.
          wait_k(c + 1);
          issue_next_qk();
          wgmma_wait<1>();  // P.V of tile c - 1 is done: its stage is free
          release_stage(c, first);
          ++skipped;
          wait_v(c);
          wgmma_fence();
          wgmma_commit();
          return;
        }
        wgmma_wait<0>();
        retire_pv(c, first);
        if (keep) {
          l_0 *= alpha0;
          l_1 *= alpha1;
          rescale_o(alpha0, alpha1);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int j = 0; j < 4; ++j) pv[kk][j] = keep_alive_copy(pv[kk][j], zero, pa[kk][j]);
          }
        } else {
          ++skipped;
        }
        sums_due = keep;

        if (MORE) wait_k(c + 1);
        wait_v(c);  // a skipped tile's V must land too before its stage is reused
        if (PINGPONG) named_sync(my_turn, 256);
        // A skipped tile still commits a second group, empty (its row sums' products, issued until 2026-12-03,
        // cost it 4% of its time), so that every step after the first starts with the same two groups in
        // flight: ptxas keeps the products asynchronous only when the groups a wait retires are the same on
        // every path. And each way of the
        // branch issues whole commit groups: a product under a branch inside a group, ptxas closes in a group
        // of its own, which the next step's wait for Q.K^T then retires, so that P.V never ran beside the
        // softmax (restoring that measured the same speed: docs/design.md, "What skip costs").
        auto issue = [&](auto keep_tag) {
          if (MORE) issue_next_qk();
          wgmma_fence();
          if constexpr (decltype(keep_tag)::value) {
            issue_pv<D>(o, pv, desc_v(s));
            issue_row_sums(sums, pv, desc_ones(s));
          }
          wgmma_commit();  // a skipped tile's group is empty
        };
        if (keep) issue(BoolConstant<true>{}); else issue(BoolConstant<false>{});
        if (PINGPONG) named_arrive(their_turn, 256);
      };
      const uint32_t end = base + static_cast<uint32_t>(n_tiles);
      if (n_tiles > 1) step(base, BoolConstant<true>{}, BoolConstant<true>{});
      for (uint32_t c = base + 1; c + 1 < end; ++c) step(c, BoolConstant<true>{}, BoolConstant<false>{});
      step(end - 1, BoolConstant<false>{}, n_tiles == 1);
      wgmma_wait<0>();
      fence_operand(o);
      fence_operand(sums);
      if (sums_due) {
        l_0 += sums[0];
        l_1 += sums[2];
      }
      if constexpr (PERSISTENT) release_stage(end, false);  // the last tile's stage: the next work tile's
    } else {
      // Per tile c: softmax of tile c (S in acc), then P.V of tile c and Q.K^T of tile c + 1 issued together,
      // so the tensor cores run them back to back, and waited for together.
      const uint32_t end = base + static_cast<uint32_t>(n_tiles);
      for (uint32_t c = base; c < end; ++c) {  // unsigned: stage and phase by masks and shifts
        const uint32_t s = c % STAGES;
        const bool more = c + 1 < end;
        if (!more) release_q();  // its last Q.K^T is done
        float alpha0, alpha1;
        const bool keep = softmax(c, c > base, BoolConstant<true>{}, alpha0, alpha1);
        if (keep) {
          rescale_o(alpha0, alpha1);
        } else {
          ++skipped;
        }

        if (more) wait_k(c + 1);
        wait_v(c);  // a skipped tile's V must land too before its stage is reused
        if (PINGPONG) named_sync(my_turn, 256);
        if (keep) {
          wgmma_fence();
          issue_pv<D>(o, pa, desc_v(s));
          issue_row_sums(sums, pa, desc_ones(s));
        }
        if (more) {
          wgmma_fence();
          issue_qk<D>(acc, desc_q, desc_k((c + 1) % STAGES));
        }
        wgmma_commit();
        if (PINGPONG) named_arrive(their_turn, 256);
        wgmma_wait<0>();
        fence_operand(o);
        fence_operand(sums);
        fence_operand(acc);
        if (keep) {
          l_0 = fmaf(l_0, alpha0, sums[0]);
          l_1 = fmaf(l_1, alpha1, sums[2]);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&sm.empty[s]);
      }
    }

    // ---- epilogue: O / l * v_scale + v_mean (and the LSE when asked), rows of this sequence only; in the persistent
    // kernel the producer meanwhile loads the next work tile's Q and first KV tiles ----
    l_0 = __shfl_sync(0xffffffff, l_0, lane & ~3);
    l_1 = __shfl_sync(0xffffffff, l_1, lane & ~3);
    const float inv0 = 1.f / (l_0 > 0.f ? l_0 : 1.f), inv1 = 1.f / (l_1 > 0.f ? l_1 : 1.f);
    // The log-sum-exp of the scaled logits, when asked: the exponent's max in log2 units (u * qs) plus log2 of the row
    // sum less P's scale, in natural log (-inf for a row without keys); one lane of each quad writes its rows.
    if (p.lse != nullptr && t == 0) {
      auto row_lse = [](float m, float qs, float l) {
        return l > 0.f ? (fmaf(m, qs, log2f(l)) - LOG2_P_SCALE) * LN2 : NEG_INF;
      };
      float* lse = p.lse + head;
      if (ok0) lse[(q_start + row0) * p.heads] = row_lse(RESCALE_SLACK > 0.f ? u_0 : m_0, qs0, l_0);
      if (ok1) lse[(q_start + row1) * p.heads] = row_lse(RESCALE_SLACK > 0.f ? u_1 : m_1, qs1, l_1);
    }
    OutT* out = static_cast<OutT*>(p.out) + head * p.out_stride_h;
    // Row r's values of columns 8j + 2t and + 1 (r: 0 for row0, 1 for row1), in OutT, packed into 4 bytes.
    auto out_pair = [&](int r, int j, float vs0, float vs1, float vm0, float vm1) {
      const float inv = r == 0 ? inv0 : inv1;
      const uint16_t lo = to_output<OutT>(fmaf(o[4 * j + 2 * r] * inv, vs0, vm0)).bits;
      const uint16_t hi = to_output<OutT>(fmaf(o[4 * j + 2 * r + 1] * inv, vs1, vm1)).bits;
      return lo | (static_cast<uint32_t>(hi) << 16);
    };
    if constexpr (STAGE_OUT) {
      constexpr int ROW = out_row_bytes(D), CHUNKS = 2 * D / 16;  // 16-byte pieces a row
      const int out_barrier = 6 + consumer;
      named_sync(out_barrier, 128);  // V's stats written (persistent: and the last work tile's rows read out)
      const uint32_t at = out_stage + (warp * 16 + g) * ROW + 4 * t, vs_at = v_stats + 8 * t;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const float vs0 = ld_shared_f32(vs_at + 32 * j), vs1 = ld_shared_f32(vs_at + 32 * j + 4);
        const float vm0 = ld_shared_f32(vs_at + 4 * D + 32 * j), vm1 = ld_shared_f32(vs_at + 4 * D + 32 * j + 4);
        st_shared_b32(at + 16 * j, out_pair(0, j, vs0, vs1, vm0, vm1));
        st_shared_b32(at + 8 * ROW + 16 * j, out_pair(1, j, vs0, vs1, vm0, vm1));
      }
      named_sync(out_barrier, 128);
      // 128 threads copy the 64 rows out, a warp covering whole rows (contiguous 16-byte stores), this sequence's only.
      const int rows = q_len - wg_first_row, first_row = tid / CHUNKS, piece = tid % CHUNKS;
      uint8_t* dst = reinterpret_cast<uint8_t*>(out + (q_start + wg_first_row + first_row) * p.out_stride_t) + 16 * piece;
      const long long step = (128 / CHUNKS) * p.out_stride_t * static_cast<long long>(sizeof(OutT));
#pragma unroll
      for (int i = 0; i < BLOCK_M * CHUNKS / 128; ++i) {
        const int r = first_row + i * (128 / CHUNKS);
        if (r < rows) copy_shared_to_global_16(dst + i * step, out_stage + r * ROW + 16 * piece);
      }
    } else {
      // Pointers at this thread's first column, columns 8j further by immediate offsets (with col = 8j + 2t in each
      // index, ptxas made every address anew in the one-tile build: its epilogue 2x as long).
      const float* v_scale = p.v_scale + kv_head * D + 2 * t;
      const float* v_mean = p.v_mean + kv_head * D + 2 * t;
      OutT* out0 = out + 2 * t + (q_start + row0) * p.out_stride_t;
      OutT* out1 = out + 2 * t + (q_start + row1) * p.out_stride_t;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const float vs0 = __ldg(v_scale + 8 * j), vs1 = __ldg(v_scale + 8 * j + 1);
        const float vm0 = __ldg(v_mean + 8 * j), vm1 = __ldg(v_mean + 8 * j + 1);
        // Two outputs a 4-byte store (an even column of a row the host allocated), not one a 2-byte store: 6.8
        // against 11.4 us a CTA on an H100 (benchmarks/results/cta_cost_h100_paired.md).
        if (ok0) *reinterpret_cast<uint32_t*>(out0 + 8 * j) = out_pair(0, j, vs0, vs1, vm0, vm1);
        if (ok1) *reinterpret_cast<uint32_t*>(out1 + 8 * j) = out_pair(1, j, vs0, vs1, vm0, vm1);
      }
    }
    if (SKIP && p.count_skipped && wg_has_rows && tid == 0) atomicAdd(p.stats, skipped);
    base += static_cast<uint32_t>(n_tiles);
  };
  if constexpr (PERSISTENT) {
    // The loop's exit is uniform through a shuffle, as n_tiles: an exit ptxas takes for divergent serialized the
    // serial build's products (C7520).
    for (uint32_t it = 0;; ++it) {
      run_tile(it);
      if (!__shfl_sync(0xffffffff, static_cast<int>(tile.next<PERSISTENT>(p)), 0)) break;
    }
  } else {
    run_tile(0);
  }
  if (PINGPONG && consumer == 0) named_sync(my_turn, 256);  // the second consumer's last arrival
}

template <int D, int STAGES, int G, bool SKIP, bool PINGPONG, bool OVERLAP, bool PERSISTENT, typename OutT>
__device__ __forceinline__ void attention(const TensorMap* map_q, const TensorMap* map_k, const TensorMap* map_v,
                                          const Params& p) {
  constexpr int QB = q_buffers<D, STAGES, PERSISTENT>();
  constexpr bool STAGE_OUT = stage_out<D, STAGES>();
  static_assert(smem_bytes<D, STAGES, PERSISTENT>() <= MAX_SMEM, "shared memory past what CTAS_PER_SM CTAs have");
  static_assert(!PINGPONG || CONSUMERS == 2, "SAGE_SM90_PINGPONG takes turns between two consumers");
  extern __shared__ uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<Smem<D, STAGES, QB, STAGE_OUT>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  {
    WorkTile tile;
    if (!tile.start<PERSISTENT>(p)) return;  // the whole CTA, before any barrier is used
  }

  // Read through a shuffle from lane 0, so that the compiler knows it is the same across the warp and keeps
  // what follows from it (the consumer's Q descriptor) in uniform registers, as the tensor-core products take them.
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x / 128), 0);
  if (threadIdx.x == 0) {
    for (int b = 0; b < QB; ++b) {
      mbar_init(&sm.full_q[b], 1);
      mbar_init(&sm.empty_q[b], CONSUMERS * 4);  // one arrival per consumer warp
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&sm.full_k[s], 1 + 32);
      mbar_init(&sm.full_v[s], 1);
      mbar_init(&sm.empty[s], CONSUMERS * 4);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // ---- producer: warp 0 streams tiles by TMA, warp 1 stages the keys' scales. Both count the CTA's KV tiles over
  // its work tiles (c), so the ring's stages and phases run on from one work tile to the next, and the next tile's
  // Q and first KV tiles load while the consumers finish the current one ----
  if (warpgroup == 0) {
    setmaxnreg_producer();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    WorkTile tile;  // (found again in each role, as in consume)
    if (warp == 0 && lane == 0) {
      tile.start<PERSISTENT>(p);
      uint32_t base = 0;
      for (uint32_t it = 0;; ++it) {
        const int kv_head = tile.head / p.group, n_tiles = tile.n_tiles();
        const uint32_t qb = it % QB;
        if (it >= QB) mbar_wait(&sm.empty_q[qb], ((it / QB) + 1) & 1);  // the consumers are done with its Q
        mbar_expect_tx(&sm.full_q[qb], CONSUMERS * BLOCK_M * D);
        tma_load_2d(sm.q[qb], map_q, &sm.full_q[qb], tile.head * D, tile.q_start + tile.m0);
        const int vt_start = 16 * (tile.kv_start / 16 + 2 * tile.seq);  // triton_quant.vt_start
#pragma unroll 1  // (the producer has 24 registers)
        for (int n = 0; n < n_tiles; ++n) {
          const uint32_t c = base + n, s = c % STAGES;
          if (c >= STAGES) mbar_wait(&sm.empty[s], ((c / STAGES) + 1) & 1);
          mbar_expect_tx(&sm.full_k[s], BLOCK_N * D);
          tma_load_2d(sm.k[s], map_k, &sm.full_k[s], kv_head * D, tile.kv_start + n * BLOCK_N);
          mbar_expect_tx(&sm.full_v[s], D * BLOCK_N);
          tma_load_2d(sm.v[s], map_v, &sm.full_v[s], vt_start + n * BLOCK_N, kv_head * D);
        }
        base += n_tiles;
        if (!tile.next<PERSISTENT>(p)) break;
      }
    } else if (warp == 1) {
      // Slots as reference.block_ids numbers them. Split per thread, the consumers' read of key 2t (t: the
      // quad lane) gives lane t's scale, which covers all of that thread's keys in the block.
      const int lane_bits = p.k_per_thread ? 2 : 0;
      tile.start<PERSISTENT>(p);
      uint32_t base = 0;
      for (;;) {
        const int kv_head = tile.head / p.group, n_tiles = tile.n_tiles(), kv_len = tile.kv_len;
        const float* k_scale =
            p.k_scale + kv_head * p.n_k_blocks + (((tile.kv_start >> p.k_shift) + tile.seq) << lane_bits);
#pragma unroll 1
        for (int n = 0; n < n_tiles; ++n) {
          const uint32_t c = base + n, s = c % STAGES;
          if (c >= STAGES) mbar_wait(&sm.empty[s], ((c / STAGES) + 1) & 1);
#pragma unroll
          for (int i = 0; i < BLOCK_N / 32; ++i) {
            const int key = min(n * BLOCK_N + lane + 32 * i, kv_len - 1);  // keys past the end are masked anyway
            const int slot = ((key >> p.k_shift) << lane_bits) + (p.k_per_thread ? (key >> 1) & 3 : 0);
            sm.k_scale[s][lane + 32 * i] = __ldg(k_scale + slot);
          }
          mbar_arrive(&sm.full_k[s]);
        }
        base += n_tiles;
        if (!tile.next<PERSISTENT>(p)) break;
      }
    }
  } else {
    consume<D, STAGES, QB, STAGE_OUT, G, SKIP, PINGPONG, OVERLAP, PERSISTENT, OutT>(sm, p, warpgroup - 1);
  }
}

}  // namespace sage_sm90

// One entry point per (head dim, output dtype, K block size, skip), named as kernels/sage_sm90.py's
// kernel_name: sage_sm90_d{D}_{bf16|fp16}_k{K block}[_skip].
#define SAGE_SM90_CAT_(A, B) A##B
#define SAGE_SM90_CAT(A, B) SAGE_SM90_CAT_(A, B)
#define SAGE_SM90_KERNEL(NAME, D, KB, SKIP, OUT)                                                            \
  extern "C" __global__ void __launch_bounds__(sage_sm90::THREADS, sage_sm90::CTAS_PER_SM)                 \
      NAME(const __grid_constant__ sage_sm90::TensorMap map_q, const __grid_constant__ sage_sm90::TensorMap map_k, \
           const __grid_constant__ sage_sm90::TensorMap map_v, const sage_sm90::Params params) {                \
    sage_sm90::attention<D, SAGE_SM90_STAGES, sage_sm90::scores_per_k_scale(KB), SKIP, SAGE_SM90_PINGPONG,    \
                         SAGE_SM90_OVERLAP, SAGE_SM90_PERSISTENT, OUT>(&map_q, &map_k, &map_v, params);     \
  }                                                                                                         \
  extern "C" __device__ const int SAGE_SM90_CAT(NAME, _smem) =                                              \
      sage_sm90::smem_bytes<D, SAGE_SM90_STAGES, SAGE_SM90_PERSISTENT>();

#define SAGE_SM90_OUT_bf16 sage_sm90::Bf16
#define SAGE_SM90_OUT_fp16 sage_sm90::Fp16
#define SAGE_SM90_SUFFIX_0
#define SAGE_SM90_SUFFIX_1 _skip
#define SAGE_SM90_ENTRY_(D, DT, KB, SKIP)                                                                      \
  SAGE_SM90_KERNEL(SAGE_SM90_CAT(sage_sm90_d##D##_##DT##_k##KB, SAGE_SM90_SUFFIX_##SKIP), D, KB, SKIP, \
                   SAGE_SM90_OUT_##DT)
#define SAGE_SM90_ENTRY(D, DT, KB, SKIP) SAGE_SM90_ENTRY_(D, DT, KB, SKIP)

#ifdef SAGE_SM90_HEAD_DIM  // one entry point, as the host builds them at first use
SAGE_SM90_ENTRY(SAGE_SM90_HEAD_DIM, SAGE_SM90_OUT, SAGE_SM90_K_BLOCK, SAGE_SM90_SKIP)
#else  // every one (the build test's ptxas report and SASS)
#define SAGE_SM90_KERNELS(D, DT)                                                                    \
  SAGE_SM90_ENTRY(D, DT, 1, 0) SAGE_SM90_ENTRY(D, DT, 1, 1) SAGE_SM90_ENTRY(D, DT, 4, 0)            \
  SAGE_SM90_ENTRY(D, DT, 4, 1) SAGE_SM90_ENTRY(D, DT, 16, 0) SAGE_SM90_ENTRY(D, DT, 16, 1)          \
  SAGE_SM90_ENTRY(D, DT, 128, 0) SAGE_SM90_ENTRY(D, DT, 128, 1)
SAGE_SM90_KERNELS(128, bf16)
SAGE_SM90_KERNELS(128, fp16)
SAGE_SM90_KERNELS(64, bf16)
SAGE_SM90_KERNELS(64, fp16)
#endif
