// Host check of the software model of each SM120 MMA instruction (mma_sm120.cuh): 32
// simulated lanes get their registers from the documented fragment and scale layouts, run the
// model (the same code the emulation build runs on the GPU, with a host operand fetch instead
// of shuffles), and the 16x8 result is compared with a plain matrix product.
// Kinds: mxf8f6f4 m16n8k32 e4m3 x e2m1 and e4m3 x e4m3, mxf4 m16n8k64 e2m1 x e2m1.
// Probes: identity A; one lane's scale byte changed; exactly representable random values;
// every unused scale byte and lane is filled with 0xFF (NaN), so reading a wrong one shows.
// Build: g++ -std=c++17 -O1 -I csrc_cuda/sm120 csrc_cuda/sm120/tests/layout_host_test.cpp
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#include "mma_sm120.cuh"

using namespace tq::sm120;

namespace {

struct Regs {
  uint32_t a[32][4], b[32][2], sfa[32], sfb[32];
  float c[32][4];
};

struct HostFetch {
  const Regs* regs;
  uint32_t a(int r, int src) const { return regs->a[src][r]; }
  uint32_t b(int r, int src) const { return regs->b[src][r]; }
  uint32_t sfa(int src) const { return regs->sfa[src]; }
  uint32_t sfb(int src) const { return regs->sfb[src]; }
};

// One instruction's operands as matrices: codes, scale bytes per (row or column, 32-k chunk).
struct Problem {
  bool k64;            // kind::mxf4 m16n8k64 (e2m1 x e2m1), else mxf8f6f4 m16n8k32 (e4m3 x b_type)
  BType b_type;        // k32: B is e2m1 (in bits 5..2 of its byte) or e4m3
  int bid_a, tid_a, bid_b, tid_b;
  uint8_t A[16][64];   // e4m3 bytes (k32) or e2m1 codes (k64)
  uint8_t B[64][8];    // e2m1 codes, or e4m3 bytes (k32 with b_type e4m3)
  uint8_t sa[16][2];   // E8M0 per row and 32-k chunk
  uint8_t sb[8][2];
  float C[16][8];
};

int kdim(const Problem& p) { return p.k64 ? 64 : 32; }
float a_value(const Problem& p, int r, int k) { return p.k64 ? e2m1_value(p.A[r][k]) : e4m3_value(p.A[r][k]); }
bool b_e4m3(const Problem& p) { return !p.k64 && p.b_type == BType::kE4m3; }
float b_value(const Problem& p, int k, int n) { return b_e4m3(p) ? e4m3_value(p.B[k][n]) : e2m1_value(p.B[k][n]); }
uint8_t e4m3_in_range(std::mt19937& rng) {  // exponent field 5..9: values in [0.25, 7.5], either sign
  return uint8_t((rng() & 0x80) | ((5 + rng() % 5) << 3) | (rng() & 7));
}
uint8_t e4m3_any(std::mt19937& rng) {  // any byte but the two NaNs (subnormals, +-448 included)
  const uint8_t b = uint8_t(rng());
  return (b & 0x7Fu) == 0x7Fu ? uint8_t(b ^ 1u) : b;
}

void distribute(const Problem& p, Regs& regs) {
  std::memset(regs.a, 0, sizeof regs.a);
  std::memset(regs.b, 0, sizeof regs.b);
  std::memset(regs.sfa, 0xFF, sizeof regs.sfa);  // unused bytes: NaN
  std::memset(regs.sfb, 0xFF, sizeof regs.sfb);
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r) {
      if (p.k64) {
        for (int i = 0; i < 8; ++i)
          regs.a[lane][r] |= uint32_t(p.A[k64_a_row(lane, r)][k64_a_k(lane, r, i)] & 15u) << (4 * i);
      } else {
        for (int j = 0; j < 4; ++j) regs.a[lane][r] |= uint32_t(p.A[k32_a_row(lane, r)][k32_a_k(lane, r, j)]) << (8 * j);
      }
    }
    for (int r = 0; r < 2; ++r) {
      if (p.k64) {
        for (int i = 0; i < 8; ++i)
          regs.b[lane][r] |= uint32_t(p.B[k64_b_k(lane, r, i)][k64_b_col(lane)] & 15u) << (4 * i);
      } else if (b_e4m3(p)) {  // one e4m3 byte per element
        for (int j = 0; j < 4; ++j) regs.b[lane][r] |= uint32_t(p.B[k32_b_k(lane, r, j)][k32_b_col(lane)]) << (8 * j);
      } else {  // e2m1 in bits 5..2 of each byte
        for (int j = 0; j < 4; ++j) regs.b[lane][r] |= uint32_t(p.B[k32_b_k(lane, r, j)][k32_b_col(lane)] & 15u) << (8 * j + 2);
      }
    }
    for (int i = 0; i < 4; ++i) regs.c[lane][i] = p.C[cd_row(lane, i)][cd_col(lane, i)];
  }
  const int chunks = p.k64 ? 2 : 1;
  for (int row = 0; row < 16; ++row) {
    for (int ch = 0; ch < chunks; ++ch) {
      uint32_t& w = regs.sfa[sfa_lane(row, p.tid_a)];
      const int byte = p.bid_a + ch;
      w = (w & ~(0xFFu << (8 * byte))) | (uint32_t(p.sa[row][ch]) << (8 * byte));
    }
  }
  for (int col = 0; col < 8; ++col) {
    for (int ch = 0; ch < chunks; ++ch) {
      uint32_t& w = regs.sfb[sfb_lane(col, p.tid_b)];
      const int byte = p.bid_b + ch;
      w = (w & ~(0xFFu << (8 * byte))) | (uint32_t(p.sb[col][ch]) << (8 * byte));
    }
  }
}

void run_model(const Problem& p, const Regs& regs, float D[16][8]) {
  const HostFetch f{&regs};
  for (int lane = 0; lane < 32; ++lane) {
    float d[4];
    if (p.k64) {
      model_mxf4_e2m1_e2m1(lane, f, p.bid_a, p.tid_a, p.bid_b, p.tid_b, regs.c[lane], d);
    } else if (b_e4m3(p)) {
      model_mxf8f6f4_e4m3<BType::kE4m3>(lane, f, p.bid_a, p.tid_a, p.bid_b, p.tid_b, regs.c[lane], d);
    } else {
      model_mxf8f6f4_e4m3<BType::kE2m1>(lane, f, p.bid_a, p.tid_a, p.bid_b, p.tid_b, regs.c[lane], d);
    }
    for (int i = 0; i < 4; ++i) D[cd_row(lane, i)][cd_col(lane, i)] = d[i];
  }
}

void reference(const Problem& p, double D[16][8]) {
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 8; ++n) {
      double acc = p.C[r][n];
      for (int k = 0; k < kdim(p); ++k)
        acc += double(a_value(p, r, k)) * b_value(p, k, n) * ue8m0_value(p.sa[r][k / 32]) * ue8m0_value(p.sb[n][k / 32]);
      D[r][n] = acc;
    }
  }
}

int failures = 0;

void expect_exact(const char* name, const Problem& p) {
  Regs regs;
  distribute(p, regs);
  float got[16][8];
  double want[16][8];
  run_model(p, regs, got);
  reference(p, want);
  int bad = 0;
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n)
      if (!(double(got[r][n]) == want[r][n])) {
        if (bad++ < 4) std::printf("  %s: D[%d][%d] = %g, expected %g\n", name, r, n, got[r][n], want[r][n]);
      }
  std::printf("%-58s %s\n", name, bad ? "FAIL" : "ok");
  failures += bad != 0;
}

Problem blank(bool k64, BType b_type, int bid_a, int tid_a, int bid_b, int tid_b) {
  Problem p;
  std::memset(&p, 0, sizeof p);
  p.k64 = k64;
  p.b_type = b_type;
  p.bid_a = bid_a;
  p.tid_a = tid_a;
  p.bid_b = bid_b;
  p.tid_b = tid_b;
  std::memset(p.sa, 127, sizeof p.sa);
  std::memset(p.sb, 127, sizeof p.sb);
  return p;
}

void fill_random(Problem& p, std::mt19937& rng, bool random_scales, bool random_c) {
  // e4m3 x e4m3: products are multiples of 2^-10 below 2^6, so 32-term sums stay exact in fp32
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < kdim(p); ++k) p.A[r][k] = p.k64 ? uint8_t(rng() % 16) : e4m3_in_range(rng);
  for (int k = 0; k < kdim(p); ++k)
    for (int n = 0; n < 8; ++n) p.B[k][n] = b_e4m3(p) ? e4m3_in_range(rng) : uint8_t(rng() % 16);
  if (random_scales) {  // k64 sums two scaled chunks: a narrower range keeps the result exact in fp32
    const int lo = p.k64 ? 125 : 120, span = p.k64 ? 5 : 15;
    for (auto& row : p.sa) for (auto& s : row) s = uint8_t(lo + rng() % span);
    for (auto& col : p.sb) for (auto& s : col) s = uint8_t(lo + rng() % span);
  }
  if (random_c)
    for (auto& row : p.C) for (auto& c : row) c = float(int(rng() % 8193) - 4096) / 64.0f;
}

void run_kind(bool k64, BType b_type, int bid_a, int tid_a, int bid_b, int tid_b, std::mt19937& rng) {
  char name[128];
  const char* kind = k64 ? "mxf4 m16n8k64" : b_type == BType::kE4m3 ? "mxf8f6f4 e4m3xe4m3 m16n8k32" : "mxf8f6f4 e4m3xe2m1 m16n8k32";
  // Identity A: D = the top 16 rows of B, element for element.
  Problem p = blank(k64, b_type, bid_a, tid_a, bid_b, tid_b);
  for (int r = 0; r < 16; ++r) p.A[r][r] = k64 ? 2 : 0x38;  // 1.0
  for (int k = 0; k < kdim(p); ++k)
    for (int n = 0; n < 8; ++n) p.B[k][n] = b_e4m3(p) ? e4m3_any(rng) : uint8_t(rng() % 16);
  std::snprintf(name, sizeof name, "%s sel{%d,%d,%d,%d} identity A", kind, bid_a, tid_a, bid_b, tid_b);
  expect_exact(name, p);
  // Identity B (its top 8 rows): D = A's columns 0..7.
  Problem q = blank(k64, b_type, bid_a, tid_a, bid_b, tid_b);
  fill_random(q, rng, false, false);
  std::memset(q.B, 0, sizeof q.B);
  for (int n = 0; n < 8; ++n) q.B[n][n] = b_e4m3(q) ? 0x38 : 2;  // 1.0
  std::snprintf(name, sizeof name, "%s sel{%d,%d,%d,%d} identity B", kind, bid_a, tid_a, bid_b, tid_b);
  expect_exact(name, q);
  // Random exactly representable values, random scales / random C.
  for (int trial = 0; trial < 4; ++trial) {
    Problem r = blank(k64, b_type, bid_a, tid_a, bid_b, tid_b);
    fill_random(r, rng, trial % 2 == 0, trial % 2 == 1);
    std::snprintf(name, sizeof name, "%s sel{%d,%d,%d,%d} random exact #%d", kind, bid_a, tid_a, bid_b, tid_b, trial);
    expect_exact(name, r);
  }
  // One lane's scale byte changed: only the rows / columns that lane carries double.
  Problem base = blank(k64, b_type, bid_a, tid_a, bid_b, tid_b);
  fill_random(base, rng, false, false);
  Regs regs;
  distribute(base, regs);
  float d0[16][8];
  run_model(base, regs, d0);
  int bad = 0;
  for (int lane = 0; lane < 32; ++lane) {
    for (int operand = 0; operand < 2; ++operand) {
      Regs changed = regs;
      uint32_t& w = operand == 0 ? changed.sfa[lane] : changed.sfb[lane];
      const int byte = operand == 0 ? bid_a : bid_b;
      if (((w >> (8 * byte)) & 0xFFu) != 127u) continue;  // this lane carries no scale here
      w += 1u << (8 * byte);                              // 127 -> 128: that chunk's scale x2
      float d1[16][8];
      run_model(base, changed, d1);
      for (int r = 0; r < 16; ++r) {
        for (int n = 0; n < 8; ++n) {
          const bool mine = operand == 0 ? sfa_lane(r, tid_a) == lane : sfb_lane(n, tid_b) == lane;
          double want = d0[r][n];
          if (mine) {  // only the first 32-k chunk's scale changed
            double first = 0.0;
            for (int k = 0; k < 32; ++k) first += double(a_value(base, r, k)) * b_value(base, k, n);
            want += first;
          }
          if (!(double(d1[r][n]) == want)) ++bad;
        }
      }
    }
  }
  std::snprintf(name, sizeof name, "%s sel{%d,%d,%d,%d} one lane's scale byte", kind, bid_a, tid_a, bid_b, tid_b);
  std::printf("%-58s %s\n", name, bad ? "FAIL" : "ok");
  failures += bad != 0;
}

}  // namespace

int main() {
  std::mt19937 rng(120);
  run_kind(false, BType::kE2m1, 0, 0, 0, 0, rng);
  run_kind(false, BType::kE2m1, 3, 1, 2, 3, rng);
  run_kind(false, BType::kE2m1, 1, 0, 3, 1, rng);
  run_kind(false, BType::kE4m3, 0, 0, 0, 0, rng);
  run_kind(false, BType::kE4m3, 3, 1, 2, 3, rng);
  run_kind(false, BType::kE4m3, 1, 0, 3, 1, rng);
  run_kind(true, BType::kE2m1, 0, 0, 0, 0, rng);
  run_kind(true, BType::kE2m1, 2, 1, 2, 3, rng);
  // Decoders against their definitions.
  int bad = 0;
  const float fp4[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  for (uint32_t c = 0; c < 16; ++c) bad += e2m1_value(c) != (c & 8 ? -fp4[c & 7] : fp4[c & 7]);
  bad += e4m3_value(0x7E) != 448.f || e4m3_value(0x01) != std::ldexp(1.f, -9) || e4m3_value(0x38) != 1.f ||
         !std::isnan(e4m3_value(0x7F)) || !std::isnan(e4m3_value(0xFF)) || e4m3_value(0xB8) != -1.f;
  bad += ue8m0_value(127) != 1.f || ue8m0_value(0) != std::ldexp(1.f, -127) || !std::isnan(ue8m0_value(255));
  std::printf("%-58s %s\n", "decoders (e2m1, e4m3, ue8m0)", bad ? "FAIL" : "ok");
  failures += bad != 0;
  std::printf("%s\n", failures ? "FAILED" : "ALL OK");
  return failures ? 1 : 0;
}
