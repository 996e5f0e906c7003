"""How exact S = Q K^T stays when Q is split into E4M3 terms (an FP8 wgmma path for the prefill
kernel's S, issue 18) against fp16 and bf16 Q, on keys made of E2M1 codes (exact in E4M3 after a
power of two: the decoded K tile loses nothing). Q scaled by a power of two so that max |q| sits
below E4M3's 448; a term is E4M3(what the terms before left). CPU only.
   python benchmarks/fp8_q_terms.py   (prints max and RMS error of S relative to max / RMS |S|)"""
import torch


def main() -> None:
    torch.manual_seed(0)
    d, n = 128, 4096
    q = torch.randn(64, d, dtype=torch.float64)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    k = e2m1[torch.randint(0, 8, (n, d))] * torch.where(torch.rand(n, d) < 0.5, -1.0, 1.0)
    s_ref = q @ k.T

    def err(qq):
        e = qq @ k.T - s_ref
        return (e.abs().max() / s_ref.abs().max()).item(), (e.pow(2).mean().sqrt() / s_ref.pow(2).mean().sqrt()).item()

    scale = 2.0 ** torch.floor(torch.log2(448.0 / q.abs().max()))
    rest, terms = q * scale, torch.zeros_like(q)
    for t in (1, 2, 3):
        term = rest.to(torch.float8_e4m3fn).to(torch.float64)
        terms, rest = terms + term, rest - term
        print(f"{t} E4M3 term(s): max {err(terms / scale)[0]:.2e}, rms {err(terms / scale)[1]:.2e}")
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        print(f"{name} Q:          max {err(q.to(dt).double())[0]:.2e}, rms {err(q.to(dt).double())[1]:.2e}")


if __name__ == "__main__":
    main()
