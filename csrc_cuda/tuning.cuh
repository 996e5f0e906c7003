// turboquant cuda backend: every tuning choice of the SM80-SM90 kernels, in one place.
// Torch-free (included by the kernels, the binding and csrc_cuda/compile_check.cu).
//
// Each constant carries a worked example. Measured numbers are in benchmarks/tune_cuda.py's
// output and in the backend's report; the examples below are the arithmetic behind the choice.
#pragma once

namespace turboquant {
namespace tuning {

// ---- paged attention ----------------------------------------------------------------------

// Warps per CTA. Every warp owns the same 16 MMA rows (the query heads of one GQA group, or
// (query token, head) pairs for multi-token queries) and walks its own KV tiles (split-K inside
// the CTA); the warps' partial softmax states are merged in shared memory at the end.
// Example D=128: 8 warps x 32 lanes = 256 threads at 128 registers (TQ_ATTN_MIN_BLOCKS = 2)
// and ~90 KB of shared memory -> 2 CTAs = 16 warps per H100 SM (the register limit), each warp
// with ATTN_STAGES-1 tiles in flight. Against 4 warps (4 CTAs of 128 threads, the same 16
// warps per SM) each warp of a partition walks half as many tiles, which shortens the serial
// per-warp chain where partitions are short: measured on H100 (CUDA graph) 136.4 vs 140.6 us
// at batch 64 x 4k, 13.7 vs 13.9 us at batch 1 x 4k, 32.6 vs 36.3 us at batch 1 x 32k.
// The merge epilogue uses 128 threads (8 per row), so ATTN_WARPS >= 4.
#ifndef TQ_ATTN_WARPS
#define TQ_ATTN_WARPS 8
#endif
constexpr int ATTN_WARPS = TQ_ATTN_WARPS;

// KV tokens per warp iteration (one MMA K-step of the P.V product, two N-tiles of Q.K^T).
// Fixed by the MMA shape (m16n8k16): do not change without rewriting the fragment maps.
constexpr int ATTN_TILE = 16;

// cp.async pipeline depth per warp (tiles in flight while one is computed).
// Bytes a warp keeps in flight = (STAGES-1) * 16 tokens * (D/2 K + D/2 V + 2 scales).
// Example D=128: 3 * 16 * 130 = 6.2 KB per warp; 16 warps -> ~100 KB per SM, ~4x what
// Little's law asks for at 3.35 TB/s / 132 SMs x ~1 us latency (~25 KB): the kernel is bound by
// instruction issue (decode), not by bytes in flight (see the backend report / ncu).
// D=256 keeps 3 stages (smem per CTA is bounded by the 64 KB merge buffer anyway).
#ifndef TQ_STAGES
template <int D> struct AttnStages { static constexpr int value = (D >= 256) ? 3 : 4; };
#else
template <int D> struct AttnStages { static constexpr int value = TQ_STAGES; };
#endif

// Lazy softmax rescaling (exp2 domain): a warp rescales its O accumulators and l only when a
// row maximum grows by more than RESCALE_SLACK over the maximum it last rescaled to, so P is
// at most 2^SLACK before the V-scale factor; P's fp16 scale 2^(b - VM + 15 - SLACK) keeps
// P' <= 2^15. Example batch 64 x 4k: a warp walks 32 tiles; with exact rescaling the 4 real
// rows of a GQA group set a new maximum in about a third of them (~110 instructions each);
// with slack 8 only the first few tiles rescale. Cost: probabilities below 2^-(9+SLACK)
// of the row maximum lose fp16 bits (they weigh < 2^-17 of the output).
#ifndef TQ_RESCALE_SLACK
#define TQ_RESCALE_SLACK 8
#endif
constexpr int RESCALE_SLACK = TQ_RESCALE_SLACK;

// Q fragments live in registers for head dims up to this, else they are re-read from shared
// memory (one 16-byte load per lane per MMA k-step).
// Example D=128: in registers the kernel needs ~160 registers -> 3 CTAs (12 warps) per SM;
// from shared memory it fits 128 registers -> 16 warps per SM: measured +4% at batch 64 x 4k
// and +15% at batch 1 x 32k on H100, so Q stays in registers only for D=64.
#ifndef TQ_QREG_MAX_D
#define TQ_QREG_MAX_D 64
#endif
constexpr int QREG_MAX_D = TQ_QREG_MAX_D;

// Minimum resident CTAs per SM requested from the register allocator (__launch_bounds__).
// Example: D<=128, 8 warps -> 2 CTAs x 256 threads -> at most 128 registers/thread (no spills
// with Q in shared memory); D=256 holds 128 fp32 accumulators per thread -> 8 warps per SM,
// 1 CTA of 8 warps (up to 255 registers).
#ifndef TQ_ATTN_MIN_BLOCKS
#define TQ_ATTN_MIN_BLOCKS (16 / TQ_ATTN_WARPS)
#endif
template <int D> struct AttnMinBlocks {
  static constexpr int value = D >= 256 ? (TQ_ATTN_MIN_BLOCKS + 1) / 2 : TQ_ATTN_MIN_BLOCKS;
};

// Split-KV (flash-decoding) partition size, chosen on the host without reading seq_lens:
// aim for TARGET_CTAS_PER_SM * num_SMs CTAs in the grid, from the host-side bound max_seq_len.
//   base   = row_tiles * num_kv_heads          (CTAs without splitting)
//   nparts = ceil(num_SMs * TARGET / base)
//   P      = round_up(ceil(max_seq_len / nparts), ATTN_WARPS * ATTN_TILE), clamped to
//            [MIN_PARTITION, MAX_PARTITION]
// Examples (H100, 132 SMs, 8 warps -> TARGET 2 -> 264 CTAs wanted; 32 q / 8 kv heads):
//   batch 64 x 4k : base 512 -> nparts 1 -> P = 4096 = whole sequence, no reduce pass
//   batch 1 x 32k : base 8   -> nparts 33 -> P = 993 -> 1024 -> 32 partitions, 256 CTAs
//   batch 1 x 4k  : base 8   -> nparts 33 -> P = 125 -> 128 -> clamped to 256 -> 16 partitions
//   batch 128 x 1k: base 1024 -> nparts 1 -> P = 1024 = whole sequence, no reduce pass
constexpr int TARGET_CTAS_PER_SM = 16 / ATTN_WARPS;  // 16 warps per SM (the register limit)
// A CTA with fewer tokens than this spends more on its prologue (Q load, block ids, merge)
// than on streaming KV. Example batch 1 x 4k: 16 partitions x 8 kv heads = 128 CTAs. Measured
// on H100 (CUDA graph, 4 warps per CTA): 13.6 us with 256, 15.2 us with 128, 15.6 with 512.
#ifndef TQ_MIN_PARTITION
#define TQ_MIN_PARTITION 256
#endif
constexpr int MIN_PARTITION = TQ_MIN_PARTITION;
// Bounds the block-table slice a CTA stages in shared memory (MAX_PARTITION/16 + 2 ints).
constexpr int MAX_PARTITION = 4096;
constexpr int MAX_BT_ENTRIES = MAX_PARTITION / ATTN_TILE + 2;

// ---- decode kernel (attention_decode.cuh: one query token, G <= 8) ----
// Warps per CTA, as in the general kernel (each warp walks its own tiles, merged at the end;
// the last step writes head r of the group from warp r, so DECODE_WARPS >= 8).
#ifndef TQ_DECODE_WARPS
#define TQ_DECODE_WARPS 8
#endif
constexpr int DECODE_WARPS = TQ_DECODE_WARPS;
// cp.async ring depth per warp (STAGES - 1 tiles in flight while one is computed).
// Example D=128: 3 x (2 x 1024 + 128) B x 8 warps = 52 KB per CTA, 2 CTAs per SM (the register
// limit below): 16 warps x 2 x 16 x 130 B = 67 KB in flight per SM. Measured on H100 (CUDA
// graph, 32/8/128): batch 64 x 4k 107.0 us with 3 stages, 110.1 with 4 (same call, noise ~2%).
#ifndef TQ_DECODE_STAGES
#define TQ_DECODE_STAGES 3
#endif
template <int D> struct DecodeStages { static constexpr int value = TQ_DECODE_STAGES; };
// CTAs per SM asked of the register allocator. Example D=128: the kernel takes ~122 registers
// at 2 CTAs x 256 threads (16 warps per SM). At 3 CTAs (80 registers) ptxas spills 88 bytes
// inside the key loop; measured on H100: batch 64 x 4k 160.4 us vs 107.0 us, so 2 it is.
#ifndef TQ_DECODE_MIN_BLOCKS
#define TQ_DECODE_MIN_BLOCKS 2
#endif
// Q^T fragments live in registers for head dims up to this (D/8 registers), else they are
// re-read from shared memory (one 8-byte load per lane per MMA k-step).
// Example: D=128 holds 16 registers of Q^T; D=256 would need 32 and spills 80 bytes at the
// 128-register limit, so D=256 re-reads them.
#ifndef TQ_DECODE_QREG_MAX_D
#define TQ_DECODE_QREG_MAX_D 128
#endif
constexpr int DECODE_QREG_MAX_D = TQ_DECODE_QREG_MAX_D;
constexpr int DECODE_MIN_BLOCKS = TQ_DECODE_MIN_BLOCKS;
// The decode kernel with 16 columns (NB = 2: short multi-token queries) holds twice the O^T
// accumulators (64 registers at D 128) and its Q^T fragments come from shared memory past
// D 64 (NB * D <= DECODE_QREG_MAX_D). Example D 128: at 2 CTAs per SM (128 registers, 0
// spills: one accumulator chain per n-block, the exp2 offset and threshold derived from the
// running maximum, the column ranges in shared memory) 64 x 4 @ 4k takes 144.7 us; at 1 CTA
// (156 registers) 170.3 us, and with Q^T in registers too (180) 178.7 us (H100, same call).
#ifndef TQ_SPEC_MIN_BLOCKS
#define TQ_SPEC_MIN_BLOCKS 2
#endif
template <int NB> struct DecodeMinBlocks {
  static constexpr int value = NB == 1 ? DECODE_MIN_BLOCKS : TQ_SPEC_MIN_BLOCKS;
};

// ---- decode on SM90a (attention_decode_wgmma.cuh: FP8 warpgroup MMAs, FP4 K and V, D 128) ----
// TQ_DECODE_WGMMA 0 keeps every decode call on the warp-MMA kernel above (A/B builds).
#ifndef TQ_DECODE_WGMMA
#define TQ_DECODE_WGMMA 1
#endif
constexpr bool DECODE_WGMMA = TQ_DECODE_WGMMA != 0;
// Ring depth (64-token steps) and CTAs per SM asked of the register allocator. Example: 4
// stages x 8704 B + 8.5 KB (Q^T, P^T, the exchange, q', the sink rows) + 1 KB of alignment =
// 43.5 KB per CTA; 5 CTAs per SM take 222.5 KB of the 228 KB (with the 1 KB each reserves)
// and 96 registers per thread, 20 warps per SM with 5 x 3 steps = 125 KB of codes in flight.
// Measured in benchmarks/wgmma_decode_probe.cu (H200, 64 x 32k, one term): 3 stages x 6 CTAs 4.7 %
// slower than 4 x 5; two-term builds spill at 6.
#ifndef TQ_DECODE_WGMMA_STAGES
#define TQ_DECODE_WGMMA_STAGES 4
#endif
#ifndef TQ_DECODE_WGMMA_MIN_BLOCKS
#define TQ_DECODE_WGMMA_MIN_BLOCKS 5
#endif
constexpr int DECODE_WGMMA_STAGES = TQ_DECODE_WGMMA_STAGES;
constexpr int DECODE_WGMMA_MIN_BLOCKS = TQ_DECODE_WGMMA_MIN_BLOCKS;
// How far (exp2 units) a logit may pass a column's running maximum m before the CTA exchanges
// maxima and rescales: P' = 2^(x + e_v - m + 8) must stay under E4M3's largest value, 448 =
// 2^8.807, so any margin below 0.807 is exact. Example: 16 x 4k, four heads per kv head,
// random logits: at margin 0 ncu counted the exchange in 6.6 of a partition's 12.8 steps (any
// new maximum of four columns), each ~77 instructions per warp and two more barriers (H200).
#ifndef TQ_DECODE_WGMMA_REDO_MARGIN
#define TQ_DECODE_WGMMA_REDO_MARGIN 0.75f
#endif
constexpr float DECODE_WGMMA_REDO_MARGIN = TQ_DECODE_WGMMA_REDO_MARGIN;
static_assert(DECODE_WGMMA_REDO_MARGIN >= 0.f && DECODE_WGMMA_REDO_MARGIN < 0.807f,
              "P' = 2^(x - m + 8 + margin) must fit E4M3 (448)");

// ---- prefill kernel (attention_prefill.cuh: multi-token rows, D <= 128) ----
// A CTA holds PREFILL_ROWS = 16 * PREFILL_WARPS rows (query token x head pairs of one
// sequence and kv head), 16 per warp; all warps walk the same KV steps of PREFILL_TILE tokens,
// whose FP4 codes are copied (PREFILL_STAGES_*-deep cp.async ring) and decoded ONCE into shared
// memory as fp16, then read by two warpgroups' wgmma (SM90a: PREFILL_WARPS more warps copy and
// decode, below) or by every warp with ldmatrix. The general kernel decodes each 16-token tile
// in registers once per 16-row tile.
// Example 1 x 2048 query tokens at 16k context, 32/8/128: 8192 rows per kv head -> 64 CTAs x
// 8 kv heads = 512 CTAs; each 64-token step's 8 KB of codes is decoded by 256 threads (32
// elements of K and 32 of V each) and feeds 8 warps x 128 MMAs, where the general kernel
// spends ~150 decode instructions per 32 MMAs. Registers of a row warp: O (64), S (32), P (16),
// Q fragments (32) -> one CTA per SM (128 KB of shared memory on SM90, below).
// (Overridable for tuning builds, e.g. -DTQ_PREFILL_WARPS=12 on the warp-MMA path (measured:
// mixed, see docs/cuda-kernels.md; the SM90a build allows at most 8: its producer warps double
// the threads) or,
// with -DTQ_PREFILL_MMA_SYNC on SM90 (the wgmma path needs 64-token steps and whole
// warpgroups), -DTQ_PREFILL_WARPS=4 -DTQ_PREFILL_TILE=32: 64 rows per CTA, two CTAs per SM; the
// V copy needs TILE * D / 32 <= 32 * WARPS.)
#ifndef TQ_PREFILL_WARPS
#define TQ_PREFILL_WARPS 8
#endif
#ifndef TQ_PREFILL_TILE
#define TQ_PREFILL_TILE 64
#endif
constexpr int PREFILL_WARPS = TQ_PREFILL_WARPS;
constexpr int PREFILL_ROWS = 16 * PREFILL_WARPS;
constexpr int PREFILL_TILE = TQ_PREFILL_TILE;
// The raw-code ring (cp.async, one stage per step): SM90a (wgmma) copies four steps ahead
// (five stages). The producers' largest stall is the wait for their own copies
// (cp.async.wait_group: 17 % of their samples in ncu, H100, 1 x 2048 @ 16k; the row warps
// wait for tiles (FULL) 7 % of theirs); five stages measure 2.3 / 1.3 / 1.1 / 1.9 % faster than
// three at 1 x 512 @ 4k, 1 x 2048 @ 16k, 1 x 8192 @ 64k, 4 x 2048 @ 16k (H100; four stages within
// 0.5 % of five), for 17 KB more shared memory (D 128 FP4: 8.7 KB a stage; K8V4 12.8 KB). With
// FP8 S's smaller tiles six stages are within 0.2 % of five and seven 2.3 % slower with K8V4 keys
// (198 KB per CTA; H100). Below SM90a three, which keeps SM86 / SM89's 99 KB (below).
// (-DTQ_PREFILL_STAGES=N sets the SM90a count.)
#ifndef TQ_PREFILL_STAGES
#define TQ_PREFILL_STAGES 5
#endif
constexpr int PREFILL_STAGES_WGMMA = TQ_PREFILL_STAGES;
constexpr int PREFILL_STAGES_MMA = 3;
constexpr int PREFILL_MIN_BLOCKS = PREFILL_WARPS >= 8 ? 1 : 8 / PREFILL_WARPS;  // 8 warps per SM
// Decoded fp16 tiles in flight. SM90a (wgmma): a warpgroup's O += P V of step k runs
// asynchronously into step k + 1, while step k + 2 is decoded: at least three buffers. Below
// (warp MMAs, synchronous): two, which also keeps SM86 / SM89's 99 KB per CTA. Example D 128,
// FP4 keys: a 43 KB ring of raw codes (5 stages) + 4 x 26 KB tiles (FP8 S's 8 KB of K rows,
// 16 KB of fp16 V, the scale words; 1 KB-aligned) + the rows' words = 150 KB on the H100 (K8V4
// keys: a 63 KB ring, 170 KB; one CTA per SM, as the registers allow); with
// 3 stages and 2 tiles 97 KB on SM80-SM89 (K8V4 keys at D 128: 109 KB, over SM86 / SM89's 99 KB:
// plan_attention sends those calls to the general kernel).
// (-DTQ_PREFILL_MMA_SYNC builds the warp-MMA path on SM90 too: the comparison build of
// `bash benchmarks/device.sh bench prefill-peers`.) SM90a takes four tiles, so that the producers run three
// steps ahead (H200: 0.5 / 1.4 / 0.8 / 0.7 % faster than three at 1 x 512 @ 4k, 1 x 2048 @ 16k,
// 1 x 8192 @ 64k, 4 x 2048 @ 16k); -DTQ_PREFILL_DEC_BUFFERS=3 builds three.
#ifndef TQ_PREFILL_DEC_BUFFERS
#define TQ_PREFILL_DEC_BUFFERS 4
#endif
constexpr int PREFILL_DEC_BUFFERS_WGMMA = TQ_PREFILL_DEC_BUFFERS;
constexpr int PREFILL_DEC_BUFFERS_MMA = 2;
// SM90a: S = Q K^T on FP8 tensor cores. With FP4 keys the producers decode K to E5M2 bytes
// (E2M1 * 2^-14 is exact in E5M2: fp4x8_to_f16hi8's fp16 high bytes, 7 integer ops per 8 codes
// where fp16 takes 11, and half the tile stores), Q is split into two E4M3 terms (Q1 = e4m3(q),
// Q2 = e4m3(q - Q1)), and S = Q1 K + Q2 K: 8 m64n64k32 FP8 MMAs where fp16 issues 8 m64n64k16, the
// same tensor time. The cost is Q's rounding: two E4M3 terms keep ~2^-8 of q's 2^-4 residual.
// K8V4 keys take the same path with their E4M3 bytes as they are (each 8 reordered like the FP4
// decode's bytes, 4 byte permutes per 16 keys' elements, no conversion; E4M3 x E4M3 MMAs).
// Measured on H100 against fp16 S at 1 x 512 @ 4k, 1 x 2048 @ 16k, 1 x 8192 @ 64k and
// 4 x 2048 @ 16k: FP4 keys at D 128 (32/8/128) 311 -> 326, 379 -> 391-396, 398 -> 419,
// 382 -> 403-404 TFLOP/s; K8V4 keys at D 128 10-13 % faster; FP4 and K8V4 keys at D 64
// (gpt-oss's head dim, 128-byte K rows half used) 4-7 % faster. The output's relative
// (Frobenius) error against the fp32 reference goes from 1.0e-3 to 2.1e-3 (FP4 keys, default
// config; plain 0.75e-3 -> 1.27e-3; K8V4 2.2e-3; D 64 1.9-2.0e-3), beside the bf16 output's own
// rounding of ~1.1e-3. Every SM90a prefill instantiation (D 64 and 128, FP4 and K8V4 keys) runs
// FP8 S. (-DTQ_PREFILL_FP8_S=0: fp16 S everywhere.)
#ifndef TQ_PREFILL_FP8_S
#define TQ_PREFILL_FP8_S 1
#endif
constexpr bool PREFILL_FP8_S = TQ_PREFILL_FP8_S;
// SM90a: PREFILL_WARPS more warps per CTA copy and decode (producers) while the PREFILL_WARPS
// row warps (consumers, two warpgroups) only compute; setmaxnreg moves registers from the
// producers to the consumers: 512 threads x 128 registers (the launch bound) = 256 x
// (PRODUCER + CONSUMER). Example D 128: a consumer holds O (64), S (32), P' (16) and Q (32)
// fragments, the softmax's logits and state; a producer one step's 16-byte chunks in flight and
// the copy addresses. The split is where ptxas (13.0) spills nothing in any of the 16
// instantiations: 40 / 216 spill 8-68 bytes (producers), 56 / 200 4-28 bytes (consumers).
constexpr int PREFILL_PRODUCER_REGS = 48;
constexpr int PREFILL_CONSUMER_REGS = 208;
static_assert(PREFILL_PRODUCER_REGS + PREFILL_CONSUMER_REGS <= 256, "64K registers per SM");
// (the SM90a kernel asserts the whole CTA's count: 32 PREFILL_WARPS x (PRODUCER + CONSUMER) <= 64K)
// The dispatcher's rule: multi-token calls whose rows average at least one prefill CTA per
// sequence (num_tokens * group size >= PREFILL_ROWS * num_seqs), D <= 128 (D 256 runs in the
// general kernel: its fp16 O and Q fragments would not fit). One partition: rows give the
// parallelism.
// Examples (G = 4): 1 x 2048 @ 16k: 8192 rows >= 128 -> prefill;
// 64 sequences x 4 tokens (speculative decoding): 16 rows per sequence < 128 -> not here
// (use_spec_kernel below; the prefill kernel would leave 7 of its 8 warps idle); a mixed
// step of 1 chunk of 512 tokens and 15 decode tokens: 2108 rows / 16 sequences = 132 -> prefill.
inline bool use_prefill_kernel(bool multi, int head_dim, long long num_tokens, long long num_seqs, int group_size) {
  return multi && head_dim <= 128 &&
         num_tokens * group_size >= (long long)PREFILL_ROWS * num_seqs;
}
// The decode-once workspace (prefill_workspace.cuh; SM90a, the prefill kernel's wgmma build):
// each KV tile is decoded once per call into a workspace the prefill kernel's CTAs copy from,
// instead of once per CTA. The kernel gains a share of its time that grows with the CTAs per
// kv head (each decoding the whole context otherwise); the pass costs a read of the codes and a
// write of three times their bytes, per key: its share of the call falls as 1 / rows per
// sequence. Measured (H200, 32/8/128, one call, the whole call without / with the workspace,
// the pass alone; `python benchmarks/probe.py prefill-workspace`, 2026-11-29, record
// benchmarks/results/2026-11-29-h200-prefill-ws-threshold.json): 1 x 256 @ 2k
// (8 groups) 66.0 / 64.9 us, pass 5.7; 1 x 512 @ 4k (16) 106.6 / 102.1, pass 9.6; 1 x 512 @
// 16k (16) 346.7 / 346.4, pass 37.5; 2 x 512 @ 8k (16) 362.3 / 360.6; 1 x 768 @ 6k (24) 267.7
// / 248.2; 1 x 1024 @ 8k (32) 348.1 / 322.0; 1 x 1024 @ 32k (32) 1313.3 / 1204.2. The kernel
// gains 11-13 % at every shape; the pass costs 9-11 % of the call at 16 groups, so that 16
// groups at 16k keys is the break-even.
// Rule: rows averaging at least PREFILL_WS_MIN_GROUPS row groups (CTAs) per sequence and kv
// head (the measured break-even), within PREFILL_WS_MAX_BYTES.
// Example (32/8/128, G = 4): 1 x 2048 @ 16k: 8192 rows = 64 groups -> workspace (51 MB);
// 1 x 512 @ 4k: 16 groups -> workspace (13 MB); 1 x 256 @ 2k: 8 groups -> the kernel decodes;
// the mixed step above (1 chunk of 512 tokens and 15 decode tokens) -> the kernel decodes (the
// rule is per call: with the decode rows' sequences 1 group each on average).
// (-DTQ_PREFILL_WS_MIN_GROUPS=N for A/B builds; TURBOQUANT_PREFILL_WORKSPACE=0 / 1 in the
// environment turns it off / on for every prefill-kernel call, within the byte bound.)
#ifndef TQ_PREFILL_WS_MIN_GROUPS
#define TQ_PREFILL_WS_MIN_GROUPS 16
#endif
constexpr int PREFILL_WS_MIN_GROUPS = TQ_PREFILL_WS_MIN_GROUPS;
constexpr long long PREFILL_WS_MAX_BYTES = 1LL << 30;  // 1 GiB: 1 x 64k keys x 8 kv heads takes 203 MB
inline bool use_prefill_workspace(long long num_tokens, long long num_seqs, int group_size) {
  return num_tokens * group_size >= (long long)PREFILL_WS_MIN_GROUPS * PREFILL_ROWS * num_seqs;
}
// With the workspace the producers only copy finished tiles: one warpgroup of them (384
// threads, 168 registers each by the launch bound) at 32 registers, and the row warps get 232
// instead of 208. Measured at 24 / 240 (H200, 2026-11-29, one call, two rounds, against two
// producer warpgroups at 48 / 208): 1 x 2048 @ 16k 1159.7 / 1164.6 against 1216.1 / 1216.1 us,
// 1 x 8192 @ 64k 17240.8 / 17214.9 against 17828.3 / 17860.3, 4 x 2048 @ 16k 4575.4 / 4574.2
// against 4770.6 / 4765.4 (3-4.5 % faster). At 24 (setmaxnreg's floor) the producers spill
// 16-24 bytes (ptxas 13.0, the overlap below built), at 32 nothing spills, and 32 / 232 is
// the faster (H200, 2026-11-29, one call, two rounds, against -DTQ_PREFILL_WS_PRODUCER_REGS=24):
// 1 x 2048 @ 16k 1152.0 / 1151.7 against 1159.8 / 1160.3 us, 1 x 8192 @ 64k 16937.7 / 16943.0
// against 16965.0 / 16977.3, 4 x 2048 @ 16k 4524.7 / 4524.7 against 4554.5 / 4553.3 (record
// benchmarks/results/2026-11-29-h200-prefill-ws-regsplit.json).
#ifndef TQ_PREFILL_WS_PRODUCER_REGS
#define TQ_PREFILL_WS_PRODUCER_REGS 32
#endif
constexpr int PREFILL_WS_PRODUCER_WARPS = 4;
constexpr int PREFILL_WS_PRODUCER_REGS = TQ_PREFILL_WS_PRODUCER_REGS;
// the row warps' share of the launch allocation (threads x (65536 / threads rounded down to 8))
constexpr int PREFILL_WS_THREADS = 32 * (PREFILL_WS_PRODUCER_WARPS + PREFILL_WARPS);
constexpr int PREFILL_WS_CONSUMER_REGS =
    (PREFILL_WS_THREADS * ((65536 / PREFILL_WS_THREADS) & ~7) -
     32 * PREFILL_WS_PRODUCER_WARPS * PREFILL_WS_PRODUCER_REGS) / (32 * PREFILL_WARPS) / 8 * 8;
// With the workspace a warpgroup issues step k's S and step k - 1's O += P' V together (one
// turn) and runs step k's softmax while that O += P' V is on the tensor cores (FA3's overlap
// inside a warpgroup), a rescale of O waiting until it is done; the extra P' fragments (16
// registers) fit the row warps' 232. Measured at 24 / 240 (H200, 2026-11-29, one call, two
// rounds, against -DTQ_PREFILL_WS_OVERLAP=0: softmax, then O += P' V): 1 x 2048 @ 16k 1138.9 /
// 1138.9 against 1162.0 / 1157.4 us, 1 x 8192 @ 64k 16870.2 / 16835.7 against 17538.3 /
// 17468.1, 4 x 2048 @ 16k 4510.4 / 4517.6 against 4619.2 / 4620.1 (2-4 % faster; 452.5 / 489.8
// / 457.1 TFLOP/s).
#ifndef TQ_PREFILL_WS_OVERLAP
#define TQ_PREFILL_WS_OVERLAP 1
#endif
constexpr bool PREFILL_WS_OVERLAP = TQ_PREFILL_WS_OVERLAP;
// Short multi-token queries (speculative decoding: 2-8 tokens per sequence) run the decode
// kernel with 16 (query token, head) columns per CTA instead of the general kernel's 16 rows:
// the same KV tiles read per 16 rows, but the swapped form's decode of K and V as MMA A
// operands and its 4-logit softmax per n-block, and the decode kernel's tuned pipeline.
// Counted from the sm_90a SASS (D 128, bf16, FP4, per 16-token tile and warp, fast path): the
// general kernel 651 instructions for 16 rows, this form 504 for 16 columns (the decode kernel
// 387 for 8). Measured on H100 against the general kernel in one call: 64 x 4 @ 4k 144.7 vs
// 149.6 us, 16 x 4 @ 16k 136.8 vs 151.8, 16 x 8 @ 16k 253.3 vs 288.5, 128 x 2 @ 4k 270.1 vs
// 280.2. Rule:
// multi-token, D <= 128, at most SPEC_MAX_COLS (query token, head) pairs per sequence on
// average, and not the prefill kernel's. Examples (32 q / 8 kv heads, G = 4): 64 x 4 tokens:
// 16 columns -> one CTA per (sequence, kv head), each KV tile read once; 64 x 8: 32 -> two
// CTAs per sequence, each reading the KV (as the general kernel's two row tiles do); 1 x 2048:
// prefill kernel; 16 x 16 tokens: 64 -> general kernel.
#ifndef TQ_SPEC_MAX_COLS
#define TQ_SPEC_MAX_COLS 32
#endif
constexpr int SPEC_MAX_COLS = TQ_SPEC_MAX_COLS;  // -DTQ_SPEC_MAX_COLS=0: the general kernel (A/B builds)
inline bool use_spec_kernel(bool multi, int head_dim, long long num_tokens, long long num_seqs, int group_size) {
  return multi && head_dim <= 128 && num_tokens * group_size <= (long long)SPEC_MAX_COLS * num_seqs &&
         !use_prefill_kernel(multi, head_dim, num_tokens, num_seqs, group_size);
}
// Which of its two forms: 8 columns (NB 1, kMulti: the decode kernel's own registers, 403
// instructions per 16-token tile and warp at D 128 against the decode's 387 and the 16-column
// form's 504, sm_90a SASS) when the (query token, head) pairs average at most 8 per sequence,
// else 16 (NB 2). A sequence with more pairs than the form's columns takes several CTAs, each
// reading the sequence's KV once.
// Examples (G = 4): 128 x 2 tokens (one draft token): 8 pairs -> 8 columns, one CTA per
// (sequence, kv head) and no padding (the 16-column form would leave half its columns empty);
// 64 x 4: 16 -> 16 columns; ragged 1-3 tokens averaging 2: 8 -> 8 columns (a 3-token
// sequence's 12 pairs take two CTAs); MHA (G = 1) with up to 8 tokens: 8 columns.
// Measured (H100, one call, against -DTQ_SPEC8=0, 32/8/128): 128 x 2 @ 16k 779-782 vs 950-954
// us (91 % of the read bandwidth), 64 x 2 @ 4k 113.5-113.8 vs 137.9-139.1, 32 x 1 @ 8k 104.0-104.5
// vs 130.5-132.0: 1.21-1.26x; 64 x 4 (16 columns in both) unchanged.
#ifndef TQ_SPEC8
#define TQ_SPEC8 1
#endif
constexpr bool SPEC8 = TQ_SPEC8;  // -DTQ_SPEC8=0: always 16 columns (A/B builds)
inline int spec_columns(long long num_tokens, long long num_seqs, int group_size) {
  return SPEC8 && num_tokens * group_size <= 8 * num_seqs ? 8 : 16;
}

// Reduce pass: one CTA of REDUCE_WARPS warps per (query token, head); each warp loads
// REDUCE_BATCH partial rows per round (D/32 floats per lane each).
// Example batch 1 x 32k (32 partitions, 32 heads): 32 CTAs, every warp loads its 8 rows in one
// round (32 registers per lane at D=128) instead of one warp walking 32 rows in 4 dependent
// rounds.
constexpr int REDUCE_WARPS = 4;
constexpr int REDUCE_BATCH = 8;

// General kernel (see the examples above).
inline int choose_partition_size(int max_seq_len, int base_ctas, int num_sms) {
  const int step = ATTN_WARPS * ATTN_TILE;
  if (base_ctas < 1) base_ctas = 1;
  long long want = (long long)num_sms * TARGET_CTAS_PER_SM;
  long long nparts = (want + base_ctas - 1) / base_ctas;
  if (nparts < 1) nparts = 1;
  long long p = ((long long)max_seq_len + nparts - 1) / nparts;
  p = (p + step - 1) / step * step;
  if (p < MIN_PARTITION) p = MIN_PARTITION;
  if (p > MAX_PARTITION) p = MAX_PARTITION;
  return (int)p;
}

// ---- cache writer -------------------------------------------------------------------------

// Cache writer: each thread quantizes WRITER_EPT consecutive elements of K and of V of one
// (token, kv head) item (EPT/8 16-byte loads of each, issued together with the slot load) and
// writes EPT/2 bytes of codes to each cache; D/EPT threads per item; CTA = WRITER_THREADS.
// Example D=128, EPT 16: 8 threads per item, 32 items per 256-thread CTA; 65536 tokens x 8
// heads -> 524288 items -> 16384 CTAs. Measured on H100 (65536 x 8 x 128 bf16): 137 us (80%
// of HBM read bandwidth, bytes read + written) with 16 vs 170 us with 8: the per-thread index
// math, slot load and group-max shuffles are shared by twice the elements.
constexpr int WRITER_THREADS = 256;
#ifndef TQ_WRITER_EPT
#define TQ_WRITER_EPT 16
#endif
constexpr int WRITER_EPT = TQ_WRITER_EPT;

// Decode kernels: the partition count n that minimizes a wave model of the run time,
//   cost(n) = ceil(base * n / slots) * (P(n) + CTA_COST) + (n > 1 ? REDUCE_COST : 0),
//   P(n) = round_up(ceil(max_seq_len / n), DECODE_WARPS * 16) >= MIN_PARTITION,
// slots = num_SMs * min_blocks (resident CTAs: DECODE_MIN_BLOCKS, or DECODE_WGMMA_MIN_BLOCKS for
// the SM90a kernel, whose 64-token steps the 128-token rounding keeps whole), P in tokens per
// CTA (all CTAs stream at the same rate), CTA_COST a CTA's prologue and merge and REDUCE_COST
// the reduce pass, both in
// token-equivalents (~1.5 us each on H100, where a CTA streams ~80 tokens per us); ties go to
// fewer partitions. The decode kernel keeps no block-table slice in shared memory, so P has
// no upper bound. Examples (H100: 132 SMs x 2 = 264 slots; 32 q / 8 kv heads):
//   batch 1 x 32k  : base 8    -> n 32: P 1024, 256 CTAs in one wave (cost 1280; n 64: two
//                                 waves of 512, 1408)
//   batch 1 x 4k   : base 8    -> n 16: P 256 (the minimum), 128 CTAs
//   batch 16 x 16k : base 128  -> n 2: P 8192, 256 CTAs in one wave (8448; n 4: two waves of
//                                 4096, 8576; n 1: 16512)
//   batch 64 x 4k  : base 512  -> n 1: two waves of 4096 (8448; n 2: four waves of 2048, 8832)
//   batch 128 x 16k: base 1024 -> n 1: four waves of 16384, no reduce pass
// The SM90a kernel's CTA_COST is its own (DECODE_WGMMA_CTA_COST): ~1400 instructions per warp
// outside the steady 64-token step's ~256 (prologue, epilogue, the first steps' maxima
// exchanges; ncu, H200, 16 x 4k), about 5.5 steps = 350 tokens. Examples (H200: 660 slots):
// 64 x 32k, base 512 -> n 5: P 6656, 2560 CTAs in 4 waves (28288; n 9: 7 waves of 3712,
// 28800); 64 x 4k -> n 1; 128 x 4k, base 1024 -> n 1: two waves of 4096 (8960; n 3: five of
// 1408, 9088). Measured against 128 (H200, one call, two rounds;
// benchmarks/results/2026-11-29-h200-decode-wgmma-sink-cost.json): 128 x 4k 142.2-142.7 us
// against 156.6-157.4, 128 x 32k 1057-1063 against 1068-1076, 64 x 32k 534-543 against
// 524-533 (the one row it may cost). Lower costs lost before: 64 (64 x 4k at n 5) 93.0 us
// against 128's 82.2, 32 / 16 (128 x 4k at n 8 / 16) 192 / 245 us against 167 (H200, one call
// each; benchmarks/results/2026-11-29-h200-shared-records-launch.json). The warp-MMA kernel
// keeps 128 (its H100 examples above).
constexpr int DECODE_CTA_COST = 128, DECODE_REDUCE_COST = 128;
constexpr int DECODE_WGMMA_CTA_COST = 384;
inline int choose_decode_partition_size(int max_seq_len, int base_ctas, int num_sms,
                                        int min_blocks = DECODE_MIN_BLOCKS,
                                        int cta_cost = DECODE_CTA_COST) {
  const long long step = DECODE_WARPS * 16, slots = (long long)num_sms * min_blocks;
  const long long L = max_seq_len > 0 ? max_seq_len : 1, base = base_ctas > 0 ? base_ctas : 1;
  long long best_p = 0, best_cost = 0;
  const long long n_max = (L + MIN_PARTITION - 1) / MIN_PARTITION;
  for (long long n = 1; n <= n_max && n <= 4 * slots; ++n) {
    long long p = (L + n - 1) / n;
    p = (p + step - 1) / step * step;
    if (p < MIN_PARTITION) p = MIN_PARTITION;
    const long long parts = (L + p - 1) / p;
    // cost(n) >= (base * parts / slots) * (L / parts + CTA_COST), which never falls as n grows
    // (parts does not): once it reaches the best cost, no larger n can win
    if (best_p != 0 && base * L + base * parts * cta_cost >= best_cost * slots) break;
    const long long cost =
        (base * parts + slots - 1) / slots * (p + cta_cost) + (parts > 1 ? DECODE_REDUCE_COST : 0);
    if (best_p == 0 || cost < best_cost) { best_p = p; best_cost = cost; }
  }
  return (int)(best_p < (1LL << 30) ? best_p : (1LL << 30));
}

}  // namespace tuning
}  // namespace turboquant
